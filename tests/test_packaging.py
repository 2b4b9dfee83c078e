"""Issue 25 (1): cxrdr as a user gets it from `pip install cxrdr` (a wheel), not from the checkout.

The wheel is built from a copy of the checkout's packaged files (the build writes build/ and
*.egg-info beside its sources), installed into a target folder outside the checkout, and used by a
fresh interpreter whose only path to cxrdr is that folder, started in a folder that is not the
checkout: it builds the cpu-D student and a shipped recipe by name, then runs `reinforce build`
(phantom:16) and `train run --model cpu-D --steps 2` as `python -m` runs them (``runpy``, in that one
interpreter: a fresh interpreter spends ~5 s of CPU on imports, which one start pays once here).
Offline: `pip wheel --no-build-isolation --no-index` needs setuptools in the environment (the dev
extra installs it); the test skips when it is missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject.toml names README.md as the long description).
SOURCES = ("setup.py", "pyproject.toml", "README.md", "cxrdr", "configs")

pytestmark = pytest.mark.slow

USER_SCRIPT = r"""
import json, sys
from pathlib import Path
import cxrdr
from cxrdr.common.configs import available, config_root
from cxrdr.experiments.recipe_file import load_recipe
from cxrdr.train.models.factory import create_student

site = Path(sys.argv[1]).resolve()
student = create_student("cpu-D")
recipe = load_recipe("cpu-demo")
print(json.dumps({"cxrdr": str(Path(cxrdr.__file__).resolve()), "configs": str(config_root().resolve()),
                  "models": available("models"), "experiments": available("experiments"),
                  "params": sum(p.numel() for p in student.parameters()), "recipe": recipe["name"],
                  "recipe_path": str(Path(recipe["_path"]).resolve())}), flush=True)


def python_m(module, *args):  # `python -m module args` in this interpreter (what -m does: runpy, as __main__)
    import runpy

    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        if end.code not in (0, None):
            raise


shards, run = sys.argv[2], sys.argv[3]
python_m("cxrdr.reinforce.cli", "build", "--source", "phantom:16", "--teachers", "random:tiny", "--n-aug", "2",
         "--n-captions", "2", "--store-size", "64", "--shard-size", "8", "--workers", "0", "--device", "cpu",
         "--quiet", "--out", shards)
python_m("cxrdr.train.cli", "run", "--shards", shards, "--model", "cpu-D", "--steps", "2", "--batch-size", "4",
         "--workers", "0", "--device", "cpu", "--no-progress", "--out", run)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel, installed with `pip install --target` into a folder outside the checkout."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: an offline `pip wheel --no-build-isolation` cannot build")
    base = tmp_path_factory.mktemp("wheel")
    src, wheels, site = base / "src", base / "wheels", base / "site"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(REPO / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__", "*.pyc")}
                                         if (REPO / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    built = subprocess.run([*pip, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                           cwd=src, capture_output=True, text=True, env=env, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = wheels.glob("cxrdr-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cxrdr/_configs/models/cpu.yaml" in names and "cxrdr/_configs/experiments/cpu-demo.yaml" in names
    assert "cxrdr/_configs/prompts.yaml" in names
    done = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                          cwd=base, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return site


def _user_env(site: Path) -> dict:
    """The installed folder is the only cxrdr on the path (no checkout, no config overrides)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CXRDR_CONFIGS", "CXRDR_MODEL_CONFIGS", "CXRDR_DEBUG")}
    return {**env, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}


def _run(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=_user_env(site), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_installed_wheel_builds_students_recipes_shards_and_runs(installed, tmp_path):
    site = installed.resolve()
    work = tmp_path / "user"
    work.mkdir()
    shards, run = work / "shards", work / "run"
    done = _run(["-c", USER_SCRIPT, str(site), str(shards), str(run)], site, work)
    probe = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"cxrdr"')))
    assert Path(probe["cxrdr"]).is_relative_to(site), probe["cxrdr"]  # not the checkout's copy
    assert Path(probe["configs"]) == site / "cxrdr" / "_configs"
    assert Path(probe["recipe_path"]).is_relative_to(site) and probe["recipe"] == "cpu-demo"
    assert {"cpu", "tiny", "default"} <= set(probe["models"]) and "cpu-demo" in probe["experiments"]
    assert probe["params"] > 0

    assert (shards / "dataset.json").is_file() and list(shards.glob("*.tar*"))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps and steps[-1] == 2
