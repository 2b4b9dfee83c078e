"""Rehearse the GPU efficiency recipe's models on this CPU before a lease: its students, teacher and image sizes,
with its CPU twin's counts.

The twin (configs/experiments/gpu-efficiency-twin.yaml) runs in the tests, but with tiny students at 64 px, so a
break in the GPU recipe's own models (ViT-S/16 + MiniLM at 224 px, the Lite2 teacher, their heads, heatmaps on a
14 x 14 grid) would first show on a lent GPU, whose minutes are few. This writes a recipe that is the twin with the
GPU recipe's models, model overrides, image sizes and loader workers (the twin keeps its step counts, so the
schedule keys that follow them, ``STEP_KEYS``, stay the twin's), and runs it end to end on the CPU (~160 s on 2
cores):

    python scripts/rehearse_gpu_recipe.py                    # into the checkout's runs/rehearsal/, then runs it
    python scripts/rehearse_gpu_recipe.py --out DIR --write-only
    python scripts/rehearse_gpu_recipe.py --probe            # then its val probe's eight arms (~170 s more) and
                                                             # the probe's rule, as MODE=probe-recipe runs them

``--probe`` writes OUT/probe.yaml, the val probe's own keys (configs/experiments/gpu-efficiency-probe.yaml) laid over
the rehearsal (its runs under OUT/probe/), runs it after the rehearsal and applies its rule (scripts/probe_choice.py
--write-recipe OUT/probe/chosen-recipe.yaml): every probe setting trains once with the GPU recipe's models.

Exit status: the experiment's (0: every unit ran). Its figures mean nothing (a few steps on a dozen images).
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cxrdr.experiments.recipe_file import recipe_out  # noqa: E402

GPU = ROOT / "configs" / "experiments" / "gpu-efficiency.yaml"
PROBE = ROOT / "configs" / "experiments" / "gpu-efficiency-probe.yaml"
TWIN = ROOT / "configs" / "experiments" / "gpu-efficiency-twin.yaml"
BUILDS = (("report", "shards", "build"), ("shards", "build"), ("teachers", "build"))
TRAININGS = (("train",), ("teachers", "train"))
NAME = "gpu-efficiency-rehearsal"
# model keys counted in steps: the twin's few steps keep their own
STEP_KEYS = ("k_anneal_steps", "keep_rate_warmup_steps")


def _at(recipe: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        recipe = recipe[key]
    return recipe


def _relocated(value, old: str, new: str):
    """Every string of ``value`` that is the folder ``old`` or a path below it, behind an optional spec prefix
    (``ckpt:``), moved to ``new``; whole path components only (``old-2/`` stays)."""
    if isinstance(value, dict):
        return {k: _relocated(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocated(v, old, new) for v in value]
    if isinstance(value, str):
        spec = "ckpt:" if value.startswith("ckpt:") else ""
        path = value[len(spec):]
        if path == old or path.startswith(old + "/"):
            return spec + new + path[len(old):]
    return value


def rehearsal_recipe(gpu: dict, twin: dict, out: Path) -> dict:
    """The twin with the GPU recipe's models, image sizes and workers, writing under ``out``."""
    recipe = _relocated(copy.deepcopy(twin), str(recipe_out(twin)), str(out))
    recipe.update(name=NAME, out=str(out), threads=None)
    for path in BUILDS:
        build, gpu_build = _at(recipe, path), _at(gpu, path)
        build["source_options"]["size"] = gpu_build["source_options"]["size"]
        build["store_size"] = gpu_build["store_size"]
        build["workers"] = gpu_build["workers"]  # more workers than the twin's shards, as the report set has
    for path in TRAININGS:
        train, gpu_train = _at(recipe, path), _at(gpu, path)
        steps = {k: v for k, v in (train.get("model_overrides") or {}).items() if k in STEP_KEYS}
        train["model"] = gpu_train["model"]
        train["workers"] = gpu_train["workers"]
        train["model_overrides"] = {**(gpu_train.get("model_overrides") or {}), **steps}
    return recipe


def rehearsal_probe(probe: dict, rehearsal: Path) -> dict:
    """The val probe's own keys laid over the rehearsal recipe (``rehearsal``: its file), writing beside it."""
    return {**probe, "extends": str(rehearsal), "name": f"{NAME}-probe", "out": str(rehearsal.parent / "probe")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "rehearsal",
                        help="folder (replaced if it holds an earlier rehearsal; refused if it holds anything else)")
    parser.add_argument("--write-only", action="store_true", help="write OUT/recipe.yaml, run nothing")
    parser.add_argument("--probe", action="store_true",
                        help="also write OUT/probe.yaml (the val probe over the rehearsal), run it and its rule")
    args = parser.parse_args(argv)
    gpu, twin = (yaml.safe_load(path.read_text()) for path in (GPU, TWIN))
    config = args.out / "recipe.yaml"
    if args.out.exists() and any(args.out.iterdir()):
        earlier = yaml.safe_load(config.read_text()) if config.is_file() else None
        if not (isinstance(earlier, dict) and earlier.get("name") == NAME):
            print(f"{args.out} is not empty and holds no earlier rehearsal: name another --out", file=sys.stderr)
            return 2
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(rehearsal_recipe(gpu, twin, args.out.resolve()), sort_keys=False))
    print(f"wrote {config}: the GPU recipe's models, image sizes and workers, the twin's counts")
    probe = args.out / "probe.yaml"
    if args.probe:
        probe.write_text(yaml.safe_dump(rehearsal_probe(yaml.safe_load(PROBE.read_text()), config.resolve()),
                                        sort_keys=False))
        print(f"wrote {probe}: the val probe's keys over the rehearsal")
    if args.write_only:
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def experiment(recipe: Path) -> int:  # `python -m cxrdr.cli` is the `train` command, run from this checkout
        return subprocess.call([sys.executable, "-m", "cxrdr.cli", "experiment", "efficiency", "--config",
                                str(recipe), "--quiet"], env=env)

    status = experiment(config)
    if status or not args.probe:
        return status
    return experiment(probe) or subprocess.call(
        [sys.executable, str(ROOT / "scripts" / "probe_choice.py"), str(args.out / "probe" / "efficiency" /
                                                                          "results.json"),
         "--recipe", str(probe), "--write-recipe", str(args.out / "probe" / "chosen-recipe.yaml")], env=env)


if __name__ == "__main__":
    sys.exit(main())
