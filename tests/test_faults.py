"""Issue 12, "nothing lost, nothing executed": hostile inputs, kills, corruption and races.

Tiny data throughout (the session's phantom:40 shards from tests/test_data.py, phantom:N builds
with the random:tiny teacher, tiny students, a few steps).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_data import build_phantom_shards

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def phantom_shards(tmp_path_factory) -> Path:
    return build_phantom_shards(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m reinforce.cli|train.cli ARGS` in a fresh process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("CXRDR_DEBUG", None)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit, stderr is a single 'error...' line (no traceback) naming every needle."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# --------------------------------------------------------------------------- 1. no pickle code


class _Payload:
    """Unpickling this creates a file: stands for any code a crafted checkpoint could run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _crafted_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"model_config": {"variant": "A"}, "model": {}, "step": _Payload(marker)}, path)
    return path


def test_crafted_checkpoint_is_refused_everywhere(tmp_path, phantom_shards):
    from train.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
    from train.models import build_student

    marker = tmp_path / "pwned"
    evil = _crafted_checkpoint(tmp_path / "evil.pt", marker)
    with pytest.raises(ValueError, match="refused"):
        read_checkpoint(evil)
    # a ckpt: teacher and a planted last.pt on --resume go through the same reader
    from reinforce.teachers import load_teacher
    with pytest.raises(Exception, match="refused"):
        load_teacher(f"ckpt:{evil}", device="cpu")
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(evil.read_bytes())
    from train.loop import train
    with pytest.raises(ValueError, match="refused"):
        train(dict(shards=str(phantom_shards), model="tiny-A", out=str(run), steps=1, batch_size=4,
                   workers=0, progress=False, device="cpu", resume=True))
    result = run_cli("train.cli", "eval", "--ckpt", str(evil), "--shards", str(phantom_shards),
                     "--out", str(tmp_path / "eval"))
    assert_one_line_error(result, "evil.pt", "refused")
    assert not marker.exists()

    # A real checkpoint (with RNG states, numpy values) still round-trips under weights_only.
    import numpy as np
    from train.loop import rng_state
    model = build_student("tiny-A")
    path = save_checkpoint(tmp_path / "ok.pt", model, rng={"0": rng_state()},
                           metrics={"auc": np.float32(0.5)}, step=3)
    data = read_checkpoint(path)
    assert data["step"] == 3 and data["metrics"]["auc"] == 0.5
    assert load_checkpoint(path).embed_dim == model.embed_dim
