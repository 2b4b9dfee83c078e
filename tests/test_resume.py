"""Issue 27: a run killed with SIGKILL and resumed ends bit-identical to the run never interrupted;
training checks each sample's CRC-32s; --resume names the shard folder by content, not by spelling.

Tiny data (the session's phantom:40 shards), the tiny-A student, a few steps of 4 samples.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml
import torch

from tests.forked_cli import python_m
from tests.test_faults import _rewrite_member, assert_one_line_error, run_cli
from tests.script_loader import load_script

REPO = Path(__file__).resolve().parents[1]
kill_resume = load_script("benchmarks/kill_resume.py")  # the by-hand check's kill and compare, shared
pytestmark = pytest.mark.usefixtures("one_thread")

# Saved every 5 steps, killed at steps that 5 mostly does not divide: the lost steps are redone.
RUN = dict(model="tiny-A", batch_size=4, device="cpu", log_every=1, save_every=5, shuffle_buffer=8)


def _flags(settings: dict) -> list[str]:
    out = []
    for name, value in settings.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out + ["--no-progress"]


def _assert_same(a, b, where: str = "") -> None:
    """Tensor equality (not closeness) throughout nested checkpoint state."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


RESTORED = ("model", "optimizer", "scheduler", "scaler", "queue", "step", "rng")


def _assert_same_run(ref: Path, run: Path) -> None:
    from cxrdr.train.checkpoint import read_checkpoint

    a, b = read_checkpoint(ref / "last.pt"), read_checkpoint(run / "last.pt")
    for part in RESTORED:
        _assert_same(a.get(part), b.get(part), part)
    _assert_same(a["data"]["streams"], b["data"]["streams"], "data.streams")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == sorted(set(steps))  # lines of the lost steps were dropped, each step logged once


def test_sigkill_at_random_steps_then_resume_is_bit_identical(phantom_shards, tmp_path):
    from cxrdr.train.checkpoint import read_checkpoint
    from cxrdr.train.loop import train

    settings = dict(shards=str(phantom_shards), steps=14, workers=2, **RUN)
    ref = tmp_path / "ref"
    train(dict(settings, out=str(ref), progress=False, loss={"queue_size": 8}))
    run = tmp_path / "run"
    config = tmp_path / "queue.yaml"
    config.write_text("loss:\n  queue_size: 8\n")
    cmd = [sys.executable, "-m", "cxrdr.train.cli", "run", "--config", str(config),
           *_flags(dict(settings, out=str(run)))]
    kills = sorted(random.Random(27).sample(range(2, 13), 3))
    for at in kills:
        reached = kill_resume.kill_group_at(cmd + (["--resume"] if (run / "last.pt").is_file() else []), run, at,
                                            start=python_m)
        assert at <= reached < 14
    saved = read_checkpoint(run / "last.pt")["step"]
    assert saved <= reached and saved % 5 == 0
    (run / ".last.pt.tmp4194304").write_bytes(b"half a checkpoint")  # what a kill mid-save leaves
    summary = train(dict(settings, out=str(run), progress=False, loss={"queue_size": 8}, resume=True))
    assert summary["start_step"] == saved and summary["steps"] == 14  # the steps after the save are redone
    assert not (run / ".last.pt.tmp4194304").exists()
    _assert_same_run(ref, run)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp(run: Path, shards: Path, *extra: str) -> list:
    """The two ranks of a gloo DDP run, started as torchrun would start them (its agent process
    left out: it would double the start-up time; forked, tests.forked_cli); one process group, so one
    SIGKILL ends both."""
    env = {**kill_resume.run_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, "-m", "cxrdr.train.cli", "run",
           *_flags(dict(shards=str(shards), out=str(run), steps=12, workers=0, **RUN)), *extra]
    ranks = []
    for rank in range(2):
        group = ranks[0].pid if ranks else 0  # 0: a new group led by rank 0
        ranks.append(python_m(cmd, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, REPO, group))
    return ranks


def _wait(ranks: list) -> str:
    errors = [proc.communicate(timeout=180)[1] for proc in ranks]
    assert all(proc.returncode == 0 for proc in ranks), errors[0][-3000:] + errors[1][-3000:]
    return errors[0]


def test_ddp_run_killed_once_resumes_bit_identical(phantom_shards, tmp_path):
    from cxrdr.train.checkpoint import read_checkpoint

    ref, run = tmp_path / "ref", tmp_path / "run"
    _wait(_ddp(ref, phantom_shards))
    ranks = _ddp(run, phantom_shards)
    deadline = time.monotonic() + 120
    while kill_resume.last_step(run) < 7:
        assert all(p.poll() is None for p in ranks) and time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(ranks[0].pid, signal.SIGKILL)
    for proc in ranks:
        proc.wait()
    saved = read_checkpoint(run / "last.pt")["step"]
    assert saved in (5, 10)
    stderr = _wait(_ddp(run, phantom_shards, "--resume"))
    assert f"at step {saved}" in stderr
    _assert_same_run(ref, run)
    assert set(read_checkpoint(run / "last.pt")["data"]["streams"]) == {"0", "1"}  # each rank's position


def test_stream_resumed_from_its_state_continues_the_same_batches(phantom_shards):
    from cxrdr.train.data import training_parts
    from cxrdr.train.integrity import CorruptPolicy
    from cxrdr.train.stream import StreamState, make_stream_loader
    from tests.test_data import fake_tokenize

    parts = training_parts(phantom_shards, "train", None, image_size=32, tokenize=fake_tokenize, seed=5)
    n_train = parts.count

    def loader(state):
        return make_stream_loader(parts, 4, state, workers=2, seed=5, shuffle_buffer=8, rank=0, world=1,
                                  policy=CorruptPolicy(), verify_checksums=True)

    state = StreamState(2)
    batches, states = [], []
    for batch in loader(state):  # past a round's end: every sample of the split comes back
        state.consumed(batch.pop("stream"))
        batches.append(batch)
        states.append(StreamState(**json.loads(json.dumps(state.to_dict()))))  # as a checkpoint holds it
        if len(batches) == n_train // 4 + 3:
            break
    assert max(p[0] for p in state.positions) >= 1
    for cut in (3, len(batches) - 2):  # an odd phase: worker 1 gives the next batch
        resumed = loader(states[cut - 1])
        for expected, got in zip(batches[cut:], resumed):
            got.pop("stream")
            assert got["key"] == expected["key"] and got["aug_params"] == expected["aug_params"]
            assert torch.equal(got["images"], expected["images"])
            assert torch.equal(got["caption_index"], expected["caption_index"])
    with pytest.raises(ValueError, match="2 worker"):
        make_stream_loader(parts, 4, StreamState(2), workers=3, seed=5, shuffle_buffer=8, rank=0, world=1,
                           policy=CorruptPolicy(), verify_checksums=False)


def test_shard_memory_keeps_only_whole_shards_within_its_budget(phantom_shards, tmp_path):
    from cxrdr.train.integrity import CheckedTarSamples, CorruptDataError, CorruptPolicy
    from cxrdr.train.stream import ShardMemory

    url = str(sorted(phantom_shards.glob("shard-*.tar.gz"))[0])
    reader = CheckedTarSamples(CorruptPolicy())
    disk = list(reader({"url": url} for _ in range(1)))
    size = sum(len(v) for sample in disk for v in sample.values() if isinstance(v, bytes))
    small = ShardMemory(size - 1)  # one byte short of the shard: read from disk each time, nothing kept
    assert list(small.read(url, reader)) == disk and not small._kept and small._bytes == 0
    memory = ShardMemory(size)
    assert list(memory.read(url, reader)) == disk == list(memory.read(url, reader)) and memory._bytes == size
    assert memory._kept[url] is not None
    cut = tmp_path / Path(url).name  # a shard cut short: the policy's business every round, never kept
    cut.write_bytes(Path(url).read_bytes()[:len(Path(url).read_bytes()) // 2])
    skipping = ShardMemory(10 * size)
    for _ in range(2):
        list(skipping.read(str(cut), CheckedTarSamples(CorruptPolicy("skip"))))
    assert not skipping._kept
    with pytest.raises(CorruptDataError, match="unreadable tar"):
        list(skipping.read(str(cut), reader))


def test_shards_kept_in_memory_give_the_stream_read_from_disk(phantom_shards):
    """ShardMemory: the later rounds of a stream read its kept shards from memory, the same batches as from disk;
    a budget too small for a shard keeps none, and a resumed stream (which replays its round) is the same too."""
    from cxrdr.train.data import training_parts
    from cxrdr.train.integrity import CorruptPolicy
    from cxrdr.train.stream import StreamState, make_stream_loader
    from tests.test_data import fake_tokenize

    parts = training_parts(phantom_shards, "train", None, image_size=32, tokenize=fake_tokenize, seed=5)
    n = 3 * parts.count // 4 + 2  # three rounds of the split, in batches of 4

    def read(memory_mb, state=None):
        loader = make_stream_loader(parts, 4, state or StreamState(0), workers=0, seed=5, shuffle_buffer=8, rank=0,
                                    world=1, policy=CorruptPolicy(), verify_checksums=True,
                                    shard_memory_mb=memory_mb)
        got = [batch for _, batch in zip(range(n), loader)]
        return got, loader.dataset.memory

    disk, none_kept = read(0)
    kept, memory = read(1)
    assert not none_kept._kept and sorted(memory._kept) == sorted(parts.urls)  # phantom:40 at 64 px: ~0.1 MB
    for a, b in zip(disk, kept, strict=True):
        assert a["key"] == b["key"] and a["stream"] == b["stream"] and torch.equal(a["images"], b["images"])
        assert all(torch.equal(a["teacher"][t]["syn"], b["teacher"][t]["syn"]) for t in a["teacher"])
    state = StreamState(0)
    for batch in kept[:n // 2]:
        state.consumed(batch["stream"])
    resumed, _ = read(1, StreamState(**state.to_dict()))
    assert [b["key"] for b in resumed[:n - n // 2]] == [b["key"] for b in kept[n // 2:]]


def _flip_inside_jpeg(data: bytes) -> bytes:
    """One bit of the JPEG's entropy-coded data: the image still decodes, to other pixels."""
    import io

    from PIL import Image

    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x04
    damaged = bytes(damaged)
    before = Image.open(io.BytesIO(data)).convert("L")
    after = Image.open(io.BytesIO(damaged)).convert("L")  # decodes: only the checksum can tell
    assert after.size == before.size and after.tobytes() != before.tobytes()
    return damaged


def test_flipped_byte_in_a_decodable_jpeg_is_caught_during_training(phantom_shards, tmp_path):
    from cxrdr.train.loop import train

    shards = tmp_path / "shards"
    shutil.copytree(phantom_shards, shards)
    info = json.loads((shards / "dataset.json").read_text())
    shard = next(s["name"] for s in info["shards"] if s["split"] == "train")
    key = _rewrite_member(shards / shard, 1, "jpg", _flip_inside_jpeg)
    steps = str(info["counts"]["train"] // 4 + 2)  # more than one pass over the split
    result = run_cli("cxrdr.train.cli", "run", "--shards", str(shards), "--model", "tiny-A", "--out",
                     str(tmp_path / "stop"), "--steps", steps, "--batch-size", "4", "--device", "cpu",
                     "--workers", "1", "--no-progress")
    assert_one_line_error(result, "corrupt training input", shard, f"key {key}", f"member {key}.jpg",
                          "differs from the build")
    settings = dict(shards=str(shards), model="tiny-A", steps=int(steps), batch_size=4, workers=0,
                    progress=False, device="cpu")
    summary = train(dict(settings, out=str(tmp_path / "skip"), on_corrupt="skip"))
    skipped = summary["skipped_corrupt"]["samples"]
    assert [(s["shard"], s["key"]) for s in skipped] == [(shard, key)] and f"{key}.jpg" in skipped[0]["reason"]
    summary = train(dict(settings, out=str(tmp_path / "unchecked"), on_corrupt="skip", verify_checksums=False))
    assert summary["skipped_corrupt"]["count"] == 0  # without the check the damage trains silently


def test_resume_takes_the_shard_folder_by_content_not_by_spelling(phantom_shards, tmp_path, monkeypatch):
    from cxrdr.train.loop import train

    run = tmp_path / "run"
    settings = dict(model="tiny-A", batch_size=4, workers=0, progress=False, device="cpu", out=str(run))
    train(dict(settings, shards=str(phantom_shards), steps=2))
    link = tmp_path / "link"
    link.symlink_to(phantom_shards)
    monkeypatch.chdir(phantom_shards.parent)
    for steps, shards in enumerate([f"./{phantom_shards.name}/", str(link)], start=3):
        summary = train(dict(settings, shards=shards, steps=steps, resume=True))
        assert summary["start_step"] == steps - 1 and summary["steps"] == steps
    moved = tmp_path / "moved"  # a copy elsewhere holds the same data
    shutil.copytree(phantom_shards, moved)
    assert train(dict(settings, shards=str(moved), steps=5, resume=True))["start_step"] == 4
    info = json.loads((moved / "dataset.json").read_text())
    info["n_captions"] += 1  # other data under the same name
    (moved / "dataset.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"shards .*\(content [0-9a-f]{16}\) -> .*moved \(content"):
        train(dict(settings, shards=str(moved), steps=6, resume=True))
    with pytest.raises(ValueError, match="1 rank\\(s\\) x 1 worker.*now 1 x 2"):
        train(dict(settings, shards=str(phantom_shards), steps=6, resume=True, workers=2))
    # naming no --workers, a resume keeps the run's own (a fresh CPU run's default is 2)
    assert train(dict(settings, shards=str(phantom_shards), steps=6, resume=True, workers=None))["start_step"] == 5
    assert yaml.safe_load((run / "config.yaml").read_text())["workers"] == 0


def test_metrics_log_resumes_over_a_line_a_killed_writer_left_unfinished(tmp_path):
    """A run killed while appending a record leaves half a line; the resumed run keeps the finished records up
    to its step and drops that half line instead of failing to parse it, and the status and curve readers
    skip it meanwhile. One record goes out in one write, however long it is."""
    from cxrdr.experiments.runs import eval_curve
    from cxrdr.train.runfolder import MetricsLog

    path = tmp_path / "metrics.jsonl"
    finished = [{"kind": "train", "step": 2}, {"kind": "eval", "step": 2, "mean_recall": 0.5},
                {"kind": "train", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in finished) + '{"kind": "eval", "step": 4, "mean_re')
    assert [p["step"] for p in eval_curve(tmp_path, 8)] == [2]
    log = MetricsLog(path, enabled=True, resume_step=3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == finished[:2]
    log.write({"kind": "train", "step": 3, "note": "x" * 20_000})  # over a buffered file's 8 KiB
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["step"] == 3 and path.read_text().endswith("\n")
