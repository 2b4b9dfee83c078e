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

from tests import forked_cli


REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m cxrdr.reinforce.cli|train.cli ARGS` in a process of its own, as a user runs it
    (forked from a server that imported torch and cxrdr once: tests.forked_cli)."""
    base = {k: v for k, v in os.environ.items() if k != "CXRDR_DEBUG"}
    env = {**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return forked_cli.run(module, list(args), env, REPO, timeout=300)


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
    from cxrdr.train.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
    from cxrdr.train.models import build_student

    marker = tmp_path / "pwned"
    evil = _crafted_checkpoint(tmp_path / "evil.pt", marker)
    with pytest.raises(ValueError, match="refused"):
        read_checkpoint(evil)
    # a ckpt: teacher and a planted last.pt on --resume go through the same reader
    from cxrdr.teachers import load_teacher
    with pytest.raises(Exception, match="refused"):
        load_teacher(f"ckpt:{evil}", device="cpu")
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(evil.read_bytes())
    from cxrdr.train.loop import train
    with pytest.raises(ValueError, match="refused"):
        train(dict(shards=str(phantom_shards), model="tiny-A", out=str(run), steps=1, batch_size=4,
                   workers=0, progress=False, device="cpu", resume=True))
    result = run_cli("cxrdr.train.cli", "eval", "--ckpt", str(evil), "--shards", str(phantom_shards),
                     "--out", str(tmp_path / "eval"))
    assert_one_line_error(result, "evil.pt", "refused")
    assert not marker.exists()

    # A real checkpoint (with RNG states, numpy values) still round-trips under weights_only.
    import numpy as np
    from cxrdr.train.rng import rng_state
    model = build_student("tiny-A")
    path = save_checkpoint(tmp_path / "ok.pt", model, rng={"0": rng_state()},
                           metrics={"auc": np.float32(0.5)}, step=3)
    data = read_checkpoint(path)
    assert data["step"] == 3 and data["metrics"]["auc"] == 0.5
    assert load_checkpoint(path).embed_dim == model.embed_dim


def test_a_config_that_names_python_code_is_refused_and_runs_nothing(tmp_path):
    """Configs are read by libyaml's parser where PyYAML has it (cxrdr.common.yamlio.safe_load), with the safe
    constructor: a python tag is an error naming the file; every shipped config reads as yaml.safe_load reads it."""
    import yaml

    from cxrdr.common.yamlio import safe_load
    from cxrdr.train.config import TrainConfig

    marker = tmp_path / "ran"
    crafted = tmp_path / "train.yaml"
    crafted.write_text(f"steps: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match=r"train.yaml: not valid YAML: .*python/object/apply"):
        TrainConfig.load(crafted)
    assert not marker.exists()
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        assert safe_load(path.read_text()) == yaml.safe_load(path.read_text()), path


def test_a_file_that_is_no_checkpoint_is_named_as_such(tmp_path):
    from cxrdr.train.checkpoint import read_checkpoint

    for name, data in (("dataset.json", b'{"total_samples": 3}'), ("empty.pt", b""), ("image.png", b"\x89PNG\r\n")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name} is not a PyTorch checkpoint"):
            read_checkpoint(tmp_path / name)
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04" + b"\0" * 40)  # a zip archive cut short: corrupt, said so
    with pytest.raises(ValueError, match="cut.pt is corrupt or not a torch checkpoint"):
        read_checkpoint(tmp_path / "cut.pt")


# --------------------------------------------------------------------------- 2. one writer per folder


def tiny_build_options(out, **overrides):
    from cxrdr.reinforce.build import BuildOptions

    base = dict(source="phantom:8", teachers="random:tiny", out=Path(out), n_aug=2, n_captions=2,
                store_size=48, shard_size=3, workers=0, batch_size=4, device="cpu", progress=False,
                merge_timeout=60, source_options={"seed": 4, "size": 96})
    base.update(overrides)
    return BuildOptions(**base)


@pytest.fixture(scope="module")
def tiny_teacher():
    from cxrdr.teachers import load_teachers

    return load_teachers("random:tiny", device="cpu")


def test_a_rank_that_joins_at_once_keeps_its_temp_files_and_a_killed_runs_are_removed(tmp_path, tiny_teacher,
                                                                                       monkeypatch):
    """The first rank removes a killed run's temp files while it holds the folder alone, before any rank can
    join: a rank that joined the moment it downgraded was writing its plan through a temp file when the first
    rank's start removed it (CI: both ranks of a two-rank build failed with FileNotFoundError on
    plan.json.tmpPID)."""
    import cxrdr.reinforce.build as build_module
    from cxrdr.common.errors import UserError
    from cxrdr.common.locking import lock_build_rank

    out = tmp_path / "shards"
    stale = out / "stats" / "plan.json.tmp999999"  # a killed run's
    stale.parent.mkdir(parents=True)
    stale.write_text("{")
    joined = out / "stats" / "plan.json.tmp424242"  # rank 1's, written as soon as it joined

    def lock_then_a_rank_joins(folder, rank, world):
        lock = lock_build_rank(folder, rank, world)
        assert lock.alone and not stale.exists()
        with lock_build_rank(folder, 1, 2) as other:
            assert not other.alone
            joined.write_text("{")
        return lock

    seen = []
    write_plan = build_module.manifest.write_plan
    monkeypatch.setattr(build_module, "lock_build_rank", lock_then_a_rank_joins)
    monkeypatch.setattr(build_module.manifest, "write_plan",
                        lambda *a, **k: (seen.append(joined.exists()), write_plan(*a, **k)))
    with pytest.raises(UserError, match="not complete"):  # rank 0 built its shards; rank 1 never builds its own
        build_module.build(tiny_build_options(out, world_size=2, rank=0, merge_timeout=0.1), teachers=tiny_teacher)
    assert seen == [True] and joined.exists()


def test_a_rank_waits_long_only_for_a_starting_rank_of_its_own_build(tmp_path):
    """The first rank holds the folder alone while it removes a killed run's temp files, so a rank of the same
    build waits for it; a build that finds another writer (add-teacher, merge) still says so within seconds."""
    from cxrdr.common.locking import (BRIEF_WAIT_S, FOLDER_LOCK, RANK_START_WAIT_S, join_wait, lock_build_rank,
                                      lock_folder)

    out = tmp_path / "shards"
    with lock_build_rank(out, 0, 2):
        with open(out / FOLDER_LOCK) as fh:
            assert join_wait(fh, 2) == RANK_START_WAIT_S and join_wait(fh, 1) == BRIEF_WAIT_S
    with lock_folder(out, "reinforce add-teacher"):
        with open(out / FOLDER_LOCK) as fh:
            assert join_wait(fh, 2) == BRIEF_WAIT_S


def test_second_writer_of_a_folder_gets_one_clear_line(tmp_path, tiny_teacher, phantom_shards):
    from cxrdr.reinforce.add_teacher import add_teachers
    from cxrdr.reinforce.build import build
    from cxrdr.common.locking import FolderBusyError, lock_build_rank, lock_folder

    out = tmp_path / "shards"
    build(tiny_build_options(out), teachers=tiny_teacher)
    with lock_build_rank(out, 0, 1):  # a build of this folder is running
        with pytest.raises(FolderBusyError, match="rank 0 is already being built by `reinforce build`"):
            build(tiny_build_options(out, seed=1, resume=True), teachers=tiny_teacher)
        with pytest.raises(FolderBusyError, match="in use"):
            add_teachers(out, "random:tiny?name=other", progress=False, teachers=tiny_teacher)
        result = run_cli("cxrdr.reinforce.cli", "merge", str(out))
        assert_one_line_error(result, str(out), "in use by `reinforce build`")
        result = run_cli("cxrdr.reinforce.cli", "build", "--source", "phantom:8", "--teachers", "random:tiny",
                         "--out", str(out), "--seed", "1", "--quiet", "--device", "cpu", "--workers", "0")
        assert_one_line_error(result, str(out), "already being built")
    # Ranks of one multi-rank build share the folder; another world size or a second rank 1 cannot.
    with lock_build_rank(out, 0, 2), lock_build_rank(out, 1, 2):
        with pytest.raises(FolderBusyError, match="rank 1 is already being built"):
            lock_build_rank(out, 1, 2)
        with pytest.raises(FolderBusyError, match="world size 1"):
            lock_build_rank(out, 0, 1)
        with pytest.raises(FolderBusyError):
            lock_folder(out, "reinforce add-teacher")
    # Released locks (also on a crash: the kernel drops them) let the next writer in.
    with lock_folder(out, "reinforce merge"):
        pass
    run = tmp_path / "run"
    with lock_folder(run, "train run"):
        from cxrdr.train.loop import train
        with pytest.raises(FolderBusyError, match="in use by `train run`"):
            train(dict(shards=str(phantom_shards), model="tiny-A", out=str(run), steps=1, batch_size=4,
                       workers=0, progress=False, device="cpu"))


# --------------------------------------------------------------------------- 3, 8. run folders


def _train(phantom_shards, out, **overrides):
    from cxrdr.train.loop import train

    cfg = dict(shards=str(phantom_shards), model="tiny-A", out=str(out), steps=2, batch_size=4, workers=0,
               progress=False, device="cpu", log_every=1)
    cfg.update(overrides)
    return train(cfg)


def test_existing_run_is_not_replaced_without_overwrite(phantom_shards, tmp_path):
    run = tmp_path / "run"
    _train(phantom_shards, run)
    before = (run / "last.pt").read_bytes()
    with pytest.raises(ValueError, match="already holds a run .*--overwrite"):
        _train(phantom_shards, run, lr=1e-3)
    assert (run / "last.pt").read_bytes() == before
    summary = _train(phantom_shards, run, lr=1e-3, steps=1, overwrite=True)
    assert summary["steps"] == 1 and summary["start_step"] == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"] == [1]  # the old run's steps 1, 2 are gone
    result = run_cli("cxrdr.train.cli", "run", "--shards", str(phantom_shards), "--model", "tiny-A", "--out", str(run),
                     "--steps", "1", "--device", "cpu", "--workers", "0", "--no-progress")
    assert_one_line_error(result, str(run), "--overwrite")


class Killed(BaseException):
    """Stands for the process dying at that instant (no ``except Exception`` catches it)."""


@pytest.mark.parametrize("dies_at, nth", [("best.pt", 1), ("last.pt", 2), ("summary.json", 1)])
def test_a_run_killed_while_writing_its_last_files_resumes_to_a_finished_run_with_its_best_checkpoint(
        phantom_shards, tmp_path, monkeypatch, dies_at, nth):
    """The final evaluation saves best.pt, then last.pt, then summary.json (the run's "done" mark), each whole or not
    at all. Killed before any of them is in place, the run is unfinished and its resume writes all three, best.pt
    the final step's (in the former order a kill between last.pt and best.pt left best.pt behind for good: last.pt
    already held the best score)."""
    from cxrdr.experiments.runs import unfinished_alike
    from cxrdr.train.checkpoint import read_checkpoint
    from cxrdr.train.config import TrainConfig

    run, real_replace, renames = tmp_path / "run", os.replace, []
    settings = dict(steps=2, save_every=1, eval_every=0)  # last.pt at step 1; validation at the end (step 2)

    def replace(src, dst):  # the process dies with the file written under its temp name, before the rename
        renames.append(Path(dst).name)
        if renames.count(dies_at) == nth:  # the final evaluation's
            raise Killed()
        return real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)
        with pytest.raises(Killed):
            _train(phantom_shards, run, **settings)
    assert not (run / "summary.json").exists()
    cfg = TrainConfig(shards=str(phantom_shards), model="tiny-A", out=str(run), batch_size=4, workers=0,
                      progress=False, device="cpu", log_every=1, **settings)
    assert unfinished_alike(run, cfg)  # what `train experiment` resumes
    summary = _train(phantom_shards, run, resume=True, **settings)
    assert json.loads((run / "summary.json").read_text())["steps"] == summary["steps"] == 2
    best, last = read_checkpoint(run / "best.pt"), read_checkpoint(run / "last.pt")
    assert best["step"] == last["step"] == 2 and summary["best_step"] == 2
    assert all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("eval", 2)]  # one run's log


def test_a_resume_killed_while_trimming_the_metrics_log_keeps_the_log(tmp_path, monkeypatch):
    from cxrdr.train.runfolder import MetricsLog

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": step}) for step in (1, 2, 3, 4)]
    path.write_text("\n".join(lines) + "\n")
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            MetricsLog(path, True, resume_step=2)
    assert path.read_text().splitlines() == lines  # the whole log, not an emptied file
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    MetricsLog(path, True, resume_step=2)
    assert path.read_text().splitlines() == lines[:2]


def test_an_overwrite_killed_while_clearing_the_old_run_leaves_no_finished_run(phantom_shards, tmp_path,
                                                                               monkeypatch):
    """--overwrite deletes the old run's summary.json (what marks a run finished) before its checkpoints."""
    from cxrdr.train.runfolder import check_run_folder

    run = tmp_path / "run"
    _train(phantom_shards, run)
    real_unlink = Path.unlink
    with monkeypatch.context() as patch:
        patch.setattr(Path, "unlink", lambda self, *a, **k: (_ for _ in ()).throw(Killed())
                      if self.name != "summary.json" else real_unlink(self, *a, **k))
        with pytest.raises(Killed):
            check_run_folder(run, resume=False, overwrite=True)
    assert not (run / "summary.json").exists() and (run / "last.pt").exists()


def test_resume_refuses_changed_settings_and_other_models(phantom_shards, tmp_path):
    from cxrdr.train.checkpoint import read_checkpoint
    from cxrdr.train.config import TrainConfig

    assert TrainConfig().save_every > 0  # a killed run with default settings keeps its progress
    run = tmp_path / "run"
    _train(phantom_shards, run, steps=2)
    with pytest.raises(ValueError, match=r"lr 0\.0005 -> 0\.001.*batch_size 4 -> 8|batch_size 4 -> 8.*lr"):
        _train(phantom_shards, run, steps=3, resume=True, lr=1e-3, batch_size=8)
    with pytest.raises(ValueError, match="model 'tiny-A' -> 'tiny-D'"):
        _train(phantom_shards, run, steps=3, resume=True, model="tiny-D")
    # steps, intervals, workers and device may change
    summary = _train(phantom_shards, run, steps=3, resume=True, eval_every=1, log_every=2, save_every=1)
    assert summary["start_step"] == 2 and summary["steps"] == 3
    # a checkpoint whose weights do not fit the configured model: one line, not a state_dict dump
    state = read_checkpoint(run / "last.pt")
    state["train_config"]["model"] = "tiny-D"
    torch.save(state, run / "last.pt")
    with pytest.raises(ValueError, match="does not fit the model 'tiny-D'") as excinfo:
        _train(phantom_shards, run, steps=4, resume=True, model="tiny-D")
    assert "\n" not in str(excinfo.value)


# --------------------------------------------------------------------------- 4. broken text in reports


def test_invalid_utf8_and_lone_surrogates_are_skipped_by_line(tmp_path, tiny_teacher):
    from cxrdr.reinforce.build import build
    from cxrdr.reinforce.summary import summary_text
    from cxrdr.reinforce.phantom import write_phantom_dataset
    from cxrdr.reinforce.sources import open_source

    jsonl = write_phantom_dataset(6, tmp_path / "data", size=96, progress=False)
    lines = jsonl.read_bytes().splitlines()
    rows = [json.loads(line) for line in lines]
    lines[1] = lines[1].replace(b'"report": "', b'"report": "\xff\xfe broken ')  # invalid UTF-8 bytes
    rows[3]["report"] = "\ud800 " + rows[3]["report"]  # json.dumps writes the escape \ud800
    lines[3] = json.dumps(rows[3]).encode()
    assert b"\\ud800" in lines[3]
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    info = build(tiny_build_options(tmp_path / "out", source=f"jsonl:{jsonl}", source_options={}),
                 teachers=tiny_teacher)
    assert info["total_samples"] == 4
    skipped = {e["id"]: e["reason"] for e in info["skipped"]["source"]["records"]}
    assert set(skipped) == {"line 2", "line 4"}
    assert all(r.startswith("bad text: records.jsonl:") and "'report'" in r for r in skipped.values())
    assert "line 2: bad text" in summary_text(info)

    csv_path = tmp_path / "data" / "rows.csv"
    header = b"id,image,report,split\n"
    good = b"a1,%s,%s,train\n" % (rows[0]["image"].encode(), rows[0]["report"].encode())
    bad = b"a2,%s,bad \xc3\x28 bytes %s,train\n" % (rows[2]["image"].encode(), rows[2]["report"].encode())
    csv_path.write_bytes(header + good + bad)
    source = open_source(f"csv:{csv_path}")
    assert [r.id for r in source] == ["a1"]
    assert source.skipped.entries == [("line 3", "bad text: rows.csv:3: field 'report' is not valid UTF-8 "
                                                 "(invalid bytes or a lone surrogate)")]


# --------------------------------------------------------------------------- 5. sample keys


def test_ids_that_sanitise_alike_get_unique_keys_before_any_work(tmp_path, tiny_teacher):
    from cxrdr.common.shards import assign_keys, check_unique_keys
    from cxrdr.reinforce.build import build
    from cxrdr.common.errors import UserError
    from cxrdr.reinforce.phantom import write_phantom_dataset
    from cxrdr.reinforce.records import Record

    jsonl = write_phantom_dataset(4, tmp_path / "data", size=96, progress=False)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for row, rid in zip(rows, ["x", "x-914ba315", "x.", "x/"]):
        row.update(id=rid, split="train")
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = build(tiny_build_options(tmp_path / "out", source=f"jsonl:{jsonl}", source_options={}),
                 teachers=tiny_teacher)
    import pyarrow.parquet as pq
    manifest = pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
    keys = {r["id"]: r["key"] for r in manifest}
    assert info["total_samples"] == 4 and len(set(keys.values())) == 4
    assert keys["x"] == "x" and keys["x-914ba315"] == "x-914ba315"

    ids = ["a", "a.", "a_", "a-86f7e437", "a/", "a?"]
    records = [Record(id=i, subject_id="s", study_id=i, split="train", report="r") for i in ids]
    for order in (records, records[::-1]):
        assert len({k for k, _ in assign_keys(order)}) == len(ids)
    with pytest.raises(UserError, match="'a' and 'a.' both get the sample key 'a'"):
        check_unique_keys([("a", records[0]), ("a", records[1])])


# --------------------------------------------------------------------------- 6. damaged shards in training


def _rewrite_member(tar: Path, index: int, ext: str, change) -> str:
    """Rewrite sample ``index`` of ``tar`` with ``change(bytes) -> bytes`` applied to member ``ext``
    (the shard keeps its compression)."""
    from cxrdr.common.shards import iter_tar_samples, shard_compression
    from cxrdr.reinforce.writer import TarOut

    samples = list(iter_tar_samples(tar))
    key = samples[index][0]
    samples[index][1][ext] = change(samples[index][1][ext])
    with open(tar, "wb") as f:
        writer = TarOut(f, shard_compression(tar.name))
        for k, sample in samples:
            writer.write({"__key__": k, **sample})
        writer.close()
    return key


def _npy_with(values) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, values)
    return buf.getvalue()


def _last_sample_start(path: Path) -> int:
    """Byte offset of the header of the last sample's first member (a cut between two samples)."""
    import tarfile

    with tarfile.open(path) as tf:
        members = tf.getmembers()
    last_key = members[-1].name.split(".", 1)[0]
    return next(m.offset for m in members if m.name.split(".", 1)[0] == last_key)


@pytest.fixture(scope="module")
def damaged_shards(phantom_shards, tmp_path_factory) -> dict:
    """A copy of the phantom shards with every train shard damaged in one way."""
    import shutil

    import numpy as np

    from cxrdr.common.shards import npy_load

    out = tmp_path_factory.mktemp("damaged") / "shards"
    shutil.copytree(phantom_shards, out)
    info = json.loads((out / "dataset.json").read_text())
    train = [s["name"] for s in info["shards"] if s["split"] == "train"]
    assert len(train) == 3
    nan_key = _rewrite_member(out / train[1], 1, "random-tiny.npy",
                              lambda b: _npy_with(np.full_like(npy_load(b), np.nan)))

    def blow_up(data: bytes) -> bytes:  # a flipped exponent bit: one coordinate becomes huge
        arr = npy_load(data).copy()
        arr.reshape(-1)[0] = np.float16(61000)
        return _npy_with(arr)

    big_key = _rewrite_member(out / train[2], 2, "random-tiny.npy", blow_up)
    with open(out / train[0], "r+b") as f:  # cut inside a member
        f.truncate((out / train[0]).stat().st_size // 2)
    return {"dir": out, "train": train, "nan_key": nan_key, "big_key": big_key}


def _read_all(shards_dir, on_corrupt="stop", log=None) -> list[str]:
    from cxrdr.train.data import make_loader
    from cxrdr.train.models import build_student

    loader = make_loader(shards_dir, "train", build_student("tiny-A"), 4, workers=0, shuffle=False,
                         drop_last=False, on_corrupt=on_corrupt, corrupt_log=log)
    return [key for batch in loader for key in batch["key"]]


def test_training_input_names_shard_and_key_then_stops_or_skips(damaged_shards, phantom_shards, tmp_path):
    import shutil

    from cxrdr.train.integrity import CorruptDataError, count_skipped

    shards, train = damaged_shards["dir"], damaged_shards["train"]
    with pytest.raises(CorruptDataError, match=f"{train[0]}: key \\(unreadable tar after "):
        _read_all(shards)
    log = tmp_path / "skipped.jsonl"
    kept = _read_all(shards, "skip", str(log))
    skipped = count_skipped(log)
    by_shard = {s["shard"]: s for s in skipped["samples"]}
    assert set(by_shard) == set(train)
    assert by_shard[train[1]]["key"] == damaged_shards["nan_key"] and "NaN" in by_shard[train[1]]["reason"]
    assert by_shard[train[2]]["key"] == damaged_shards["big_key"]
    assert "not unit vectors" in by_shard[train[2]]["reason"]
    assert damaged_shards["nan_key"] not in kept and damaged_shards["big_key"] not in kept
    clean = _read_all(phantom_shards)
    assert len(kept) < len(clean) - 2 and set(kept) < set(clean)

    # Cut exactly at a member boundary (inside an intact gzip stream): webdataset's reader lost the rest
    # silently; this stops.
    import gzip

    cut = tmp_path / "cut"
    shutil.copytree(phantom_shards, cut)
    tar = cut / train[0]
    assert tar.name.endswith(".tar.gz")
    whole = gzip.decompress(tar.read_bytes())
    tar.write_bytes(gzip.compress(whole[:_last_sample_start(tar)]))  # the last sample and the end marker are gone
    with pytest.raises(CorruptDataError, match=f"{train[0]}: key \\(unreadable tar after .*end-of-archive"):
        _read_all(cut)


def test_a_sample_whose_view_parameters_replay_cannot_read_is_named_and_skipped(phantom_shards, tmp_path):
    """The loaders replay a batch's views together in the collate; a sample's unreadable parameters
    are still found in its own step, where it is named and skipped (or stops the run)."""
    import shutil

    from cxrdr.train.integrity import CorruptDataError, count_skipped

    shards = tmp_path / "shards"
    shutil.copytree(phantom_shards, shards)
    train = [s["name"] for s in json.loads((shards / "dataset.json").read_text())["shards"] if s["split"] == "train"]

    def crop_as_text(data: bytes) -> bytes:
        meta = json.loads(data)
        meta["aug"] = [{**params, "crop": "0 0 64 64"} for params in meta["aug"]]
        return json.dumps(meta).encode()

    key = _rewrite_member(shards / train[1], 0, "json", crop_as_text)
    with pytest.raises(CorruptDataError, match=f"{train[1]}: key {key}.*crop must be 4 numbers"):
        _read_all(shards)
    log = tmp_path / "skipped.jsonl"
    kept = _read_all(shards, "skip", str(log))
    assert [s["key"] for s in count_skipped(log)["samples"]] == [key] and key not in kept
    assert len(kept) == len(_read_all(phantom_shards)) - 1


def test_train_run_on_damaged_shards_is_one_line_or_skips_and_counts(damaged_shards, tmp_path):
    result = run_cli("cxrdr.train.cli", "run", "--shards", str(damaged_shards["dir"]), "--model", "tiny-A",
                     "--out", str(tmp_path / "stop"), "--steps", "2", "--batch-size", "4", "--device", "cpu",
                     "--workers", "1", "--no-progress")
    line = assert_one_line_error(result, "corrupt training input", "shard-00000", "--on-corrupt skip")
    assert "DataLoader worker" not in line
    summary = _train(damaged_shards["dir"], tmp_path / "skip", steps=2, on_corrupt="skip")
    assert summary["steps"] == 2 and summary["skipped_corrupt"]["count"] >= 1


# --------------------------------------------------------------------------- 7. content checksums


def test_verify_catches_bit_rot_in_any_member_and_add_teacher_keeps_checksums(tmp_path, tiny_teacher):
    import shutil

    from cxrdr.reinforce.add_teacher import add_teachers
    from cxrdr.reinforce.build import build
    from cxrdr.teachers import load_teachers
    from cxrdr.reinforce.verify import verify

    out = tmp_path / "shards"
    # plain tars: a changed member then keeps the file's size, so only the checksums can tell
    build(tiny_build_options(out, compression="none"), teachers=tiny_teacher)
    other = load_teachers("random:tiny?name=other", device="cpu")
    add_teachers(out, "random:tiny?name=other", progress=False, teachers=other)
    assert verify(out)[0] == []
    stats = json.loads((out / "stats" / "shard-000000.json").read_text())
    members = next(iter(stats["checksums"]["samples"].values()))
    assert {"jpg", "txt", "json", "other.npy", "random-tiny.npy"} <= set(members)  # schema 2: one member per teacher

    def flip(offset_from_end: int, bit: int):
        def change(data: bytes) -> bytes:
            data = bytearray(data)
            data[len(data) - offset_from_end] ^= 1 << bit
            return bytes(data)
        return change

    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    cases = [("shard-000000.tar", 0, "jpg", flip(200, 3)),                     # JPEG entropy data
             ("shard-000001.tar", 1, "random-tiny.npy", flip(2, 0)),           # lowest mantissa bit
             ("shard-000002.tar", 0, "txt", lambda b: b.replace(b"e", b"a", 1))]  # an edited report
    for shard, index, ext, change in cases:
        key = _rewrite_member(damaged / shard, index, ext, change)
        # the tar keeps its size, and each change alone passes every other check
        assert (damaged / shard).stat().st_size == (out / shard).stat().st_size
        problems, _ = verify(damaged)
        assert any(p.startswith(f"{shard}: key {key}: member {key}.{ext} content differs") for p in problems), problems
    assert len(problems) == 3, problems


# --------------------------------------------------------------------------- 9. config types


@pytest.mark.parametrize("yaml_text, needle", [
    ("resume: 'no'", "'resume': expected true or false, got 'no'"),
    ("steps: 2.7", "'steps': expected an integer, got 2.7"),
    ("lr: fast", "'lr': expected a finite number, got 'fast'"),
    ("eval_every: -5", "'eval_every': must be in [0, inf), got -5"),
    ("llrd: 1.5", "'llrd': must be in (0, 1], got 1.5"),
    ("teachers: 3", "'teachers': expected a string or null, got 3"),
    ("loss: [1, 2]", "'loss': expected a mapping"),
])
def test_config_fields_are_typed_and_ranged(tmp_path, yaml_text, needle):
    from cxrdr.train.config import TrainConfig

    path = tmp_path / "cxrdr.train.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(ValueError) as excinfo:
        TrainConfig.load(path)
    assert str(excinfo.value).startswith(f"{path}: training config field ")
    assert needle in str(excinfo.value)


def test_nested_configs_and_coercions():
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.losses import LossConfig
    from cxrdr.train.optim import OptimConfig

    cfg = TrainConfig(optim={"lr": "1e-3", "weight_decay": 0}, steps=5)  # YAML 1.1 reads 1e-3 as a string
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.weight_decay, float)
    assert OptimConfig.from_dict({"betas": [0.9, 0.95]}).betas == (0.9, 0.95)
    with pytest.raises(ValueError, match="optim option 'warmup_steps': expected an integer"):
        OptimConfig.from_dict({"warmup_steps": "10"})
    with pytest.raises(ValueError, match=r"optim option 'betas': expected a list of 2 values"):
        OptimConfig.from_dict({"betas": [0.9]})
    with pytest.raises(ValueError, match="loss option 'use_syn': expected true or false"):
        LossConfig.from_dict({"use_syn": "yes"})
    with pytest.raises(ValueError, match=r"loss option 'queue_size': must be in \[0, inf\)"):
        LossConfig.from_dict({"queue_size": -1})
    with pytest.raises(ValueError, match="loss option 'teacher_scales': expected a finite number"):
        LossConfig.from_dict({"teacher_scales": {"minilm": "hot"}})


def test_config_errors_reach_the_cli_as_one_line(tmp_path, phantom_shards):
    path = tmp_path / "cxrdr.train.yaml"
    path.write_text("lr: fast\n")
    result = run_cli("cxrdr.train.cli", "run", "--config", str(path), "--shards", str(phantom_shards),
                     "--out", str(tmp_path / "run"))
    assert_one_line_error(result, str(path), "'lr'")


# --------------------------------------------------------------------------- kill -9, resume, temp files


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 240.0) -> None:
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the process never reached the kill point"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _popen(module: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, cwd=REPO)


def test_build_killed_with_sigkill_resumes_to_identical_shards(tmp_path, tiny_teacher):
    from cxrdr.reinforce.build import build
    from cxrdr.reinforce.verify import verify

    n = 30
    reference = tmp_path / "reference"
    build(tiny_build_options(reference, source=f"phantom:{n}"), teachers=tiny_teacher)
    out = tmp_path / "killed"
    proc = _popen("cxrdr.reinforce.cli", "build", "--source", f"phantom:{n}", "--source-seed", "4", "--phantom-size", "96",
                  "--teachers", "random:tiny", "--out", str(out), "--n-aug", "2", "--n-captions", "2",
                  "--store-size", "48", "--shard-size", "3", "--batch-size", "4", "--workers", "0",
                  "--device", "cpu", "--quiet")
    _kill_when(proc, lambda: (out / "stats" / "shard-000001.json").is_file())
    assert not (out / "dataset.json").exists()  # killed mid-build
    stale = out / "stats" / "shard-000009.json.tmp4194304"  # a temp file a killed process left
    stale.write_text("{")
    info = build(tiny_build_options(out, source=f"phantom:{n}", resume=True), teachers=tiny_teacher)
    assert info["build"]["ranks"][0]["shards_skipped_as_complete"] >= 2
    assert not stale.exists()
    tars = sorted(p.name for p in reference.glob("*.tar.gz"))  # gzip with mtime 0: as reproducible as a tar
    assert tars == sorted(p.name for p in out.glob("*.tar.gz")) and len(tars) == 10
    for name in tars:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert (out / "manifest.parquet").read_bytes() == (reference / "manifest.parquet").read_bytes()
    assert verify(out)[0] == []


def test_unexpected_errors_are_one_line_unless_debugging(tmp_path):
    bad = tmp_path / "shards"
    bad.mkdir()
    (bad / "stats").mkdir()
    (bad / "stats" / "plan.json").write_text('{"shards": 5}')  # a TypeError deep inside merge
    result = run_cli("cxrdr.reinforce.cli", "merge", str(bad))
    assert result.returncode == 1
    assert_one_line_error(result, "error (TypeError):", "CXRDR_DEBUG=1")
    result = run_cli("cxrdr.reinforce.cli", "merge", str(bad), env={"CXRDR_DEBUG": "1"})
    assert "Traceback" in result.stderr
