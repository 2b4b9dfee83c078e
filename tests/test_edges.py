"""Issue 38, crash-safe at the edges: `train eval` finds the run's own shards; a batch that does not
fit in GPU memory is one line (batch size, device memory, peak, the flags that help), exit code 1,
and leaves a folder that --resume continues.

Out-of-memory is simulated on CPU: torch.cuda.OutOfMemoryError raised from a training step or a
teacher batch, and the device's memory figures patched in (no CUDA here). Tiny data (the session's
phantom:40 shards, phantom:N builds with random:tiny), the tiny-A student, a few steps.
"""
from __future__ import annotations

import shutil
import sys

import pytest
import torch

from tests.test_faults import tiny_build_options
from tests.test_resume import _assert_same

pytestmark = pytest.mark.usefixtures("one_thread")

GIB = 1024**3
OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which "
            "1.10 GiB is free.")
FAKE_GPU = {"device": "cuda:0", "name": "Fake GPU", "total": 80 * GIB, "peak_allocated": 77 * GIB,
            "peak_reserved": int(78.5 * GIB)}


def _cli(monkeypatch, capsys, main, *args: str) -> tuple[int, str]:
    """A console script in this process (so monkeypatches reach it): exit code and stderr."""
    monkeypatch.setattr(sys, "argv", ["cxrdr", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code, capsys.readouterr().err


def _one_line(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len([l for l in lines if l.startswith("error")]) == 1, err
    line = next(l for l in lines if l.startswith("error"))
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_eval_of_a_checkpoint_uses_its_runs_shards_and_names_them_when_moved(phantom_shards, tmp_path, monkeypatch,
                                                                             capsys):
    from cxrdr.train import cli
    from cxrdr.train.loop import train

    monkeypatch.delenv("CXRDR_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./shards here
    shards, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(phantom_shards, shards)  # a copy: moved below
    train(dict(shards=str(shards), model="tiny-A", steps=2, batch_size=4, workers=0, progress=False, device="cpu",
               out=str(run)))
    flags = ["eval", "--ckpt", str(run / "last.pt"), "--split", "test", "--no-efficiency", "--quiet", "--device",
             "cpu", "--n-localisation", "4", "--n-faithfulness", "2", "--faith-steps", "3", "--n-plots", "0",
             "--probe-max-train", "16"]
    code, err = _cli(monkeypatch, capsys, cli.main, *flags)
    assert code in (0, None), err
    assert f"note: no --shards: using {shards.resolve()}, the shard folder {run / 'last.pt'} was trained on" in err
    assert (run / "eval-test" / "eval.json").is_file()
    shards.rename(tmp_path / "moved")
    code, err = _cli(monkeypatch, capsys, cli.main, *flags)
    assert code == 2
    _one_line(err, f"--ckpt {run / 'last.pt'} was trained on shards {shards.resolve()}", "no dataset.json",
              "pass --shards DIR")


def _oom_after(real, calls: int):
    """``real`` that raises CUDA's out-of-memory error from its ``calls``-th call on."""
    count = {"n": 0}

    def step(*args, **kwargs):
        count["n"] += 1
        if count["n"] >= calls:
            raise torch.cuda.OutOfMemoryError(OOM_TEXT)
        return real(*args, **kwargs)

    return step


def test_out_of_memory_in_a_training_step_is_one_line_and_the_run_resumes(phantom_shards, tmp_path, monkeypatch,
                                                                          capsys):
    from cxrdr.common import oom
    from cxrdr.train import cli
    from cxrdr.train.checkpoint import read_checkpoint
    from cxrdr.train.loop import Trainer, train

    monkeypatch.delenv("CXRDR_DEBUG", raising=False)
    settings = dict(shards=str(phantom_shards), model="tiny-A", steps=8, batch_size=4, workers=0, device="cpu",
                    save_every=2, progress=False)
    run = tmp_path / "run"
    flags = ["train", "run", "--out", str(run), "--no-progress"]
    for name, value in settings.items():
        if name != "progress":
            flags += [f"--{name.replace('_', '-')}", str(value)]
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", _oom_after(Trainer.train_step, 6))  # steps 1-5 done, saved at 4
        patch.setattr(oom, "device_memory", lambda device=None: FAKE_GPU)
        code, err = _cli(monkeypatch, capsys, cli.main, *flags[1:])
    assert code == 1
    _one_line(err, "out of GPU memory in a training step", "--batch-size 4 x --accum-steps 1",
              "cuda:0 (Fake GPU) has 80.0 GiB", "peak 77.0 GiB allocated (78.5 GiB reserved)", "2.00 GiB more",
              f"{run / 'last.pt'} from the last save is intact", "--resume --grad-checkpointing",
              "smaller --batch-size and a larger --accum-steps")
    assert read_checkpoint(run / "last.pt")["step"] == 4
    assert not [p.name for p in run.iterdir() if ".tmp" in p.name]  # nothing half-written
    # --resume continues it (with the flag the line names) to the end of the run never interrupted.
    summary = train(dict(settings, out=str(run), resume=True, grad_checkpointing=True))
    assert summary["start_step"] == 4 and summary["steps"] == 8
    train(dict(settings, out=str(tmp_path / "ref")))
    a, b = read_checkpoint(tmp_path / "ref" / "last.pt"), read_checkpoint(run / "last.pt")
    for part in ("model", "optimizer", "step"):
        _assert_same(a[part], b[part], part)
    # Not in a step but in a validation pass: the validation batch size, changeable on resume.

    def evaluate():
        raise torch.cuda.OutOfMemoryError(OOM_TEXT)

    with pytest.raises(torch.cuda.OutOfMemoryError) as exc:
        evaluate()
    from cxrdr.train.config import TrainConfig

    line = cli.train_oom_line(TrainConfig.from_dict(dict(settings, out=str(run))), exc.value)
    assert "a validation pass" in line and "smaller --eval-batch-size" in line
    assert "device memory and peak unknown (CUDA not initialised in this process)" in line  # no CUDA here


def test_out_of_memory_in_a_teacher_batch_of_a_build_is_one_line_and_resumes(tmp_path, monkeypatch, capsys):
    from cxrdr.common import oom
    from cxrdr.reinforce import cli, pipeline
    from cxrdr.reinforce.build import build
    from cxrdr.reinforce.verify import verify

    monkeypatch.delenv("CXRDR_DEBUG", raising=False)
    out = tmp_path / "shards"
    flags = ["build", "--source", "phantom:12", "--source-seed", "4", "--phantom-size", "96", "--teachers",
             "random:tiny", "--out", str(out), "--n-aug", "2", "--n-captions", "2", "--store-size", "48",
             "--shard-size", "3", "--workers", "0", "--device", "cpu", "--quiet"]
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "queue_batch", _oom_after(pipeline.queue_batch, 3))  # 2 batches of 4 embedded
        patch.setattr(oom, "device_memory", lambda device=None: FAKE_GPU)
        code, err = _cli(monkeypatch, capsys, cli.main, *flags, "--batch-size", "4")
    assert code == 1
    _one_line(err, "out of GPU memory in a teacher batch of `reinforce build` at --batch-size 4",
              "cuda:0 (Fake GPU) has 80.0 GiB", "peak 77.0 GiB", "--resume and a smaller --batch-size")
    assert not (out / "dataset.json").exists() and (out / "stats" / "shard-000000.json").is_file()
    assert not list(out.rglob("*.tmp[0-9]*"))  # nothing half-written
    code, err = _cli(monkeypatch, capsys, cli.main, *flags, "--batch-size", "2", "--resume")
    assert code in (0, None), err
    assert verify(out)[0] == []
    reference = tmp_path / "reference"
    build(tiny_build_options(reference, source="phantom:12"))
    for tar in sorted(reference.glob("*.tar.gz")):
        assert (out / tar.name).read_bytes() == tar.read_bytes(), tar.name
