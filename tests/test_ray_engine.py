"""`reinforce build --engine ray` on a local Ray instance (2 CPUs): the same shard folder as the
single-process build, resume by shard, retries, failed shards named, skipped records logged.

Tiny builds: 12 phantom studies written as a jsonl folder (one image unreadable), K=2, S=2, 64 px, random:tiny
teacher, shards of 4 records. Each Ray build starts an actor pool (~8 s on two cores), so one test makes both:
a build that fails and its resume, which is compared with the single-process build.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cxrdr.reinforce.build import BuildOptions, build
from cxrdr.common.errors import UserError
from cxrdr.reinforce.ray_engine import FAULTS_ENV, error_path, init_ray
from cxrdr.reinforce.verify import verify
from cxrdr.reinforce.writer import is_shard_complete, stats_path

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

N = 12
SOURCE_SEED = 4  # the first 12 studies span train, val and test: shards never mix splits
UNREADABLE = 5  # the record whose image is damaged: in shard 1, the one that fails and is resumed


def options(out, **overrides) -> BuildOptions:
    base = dict(source=f"phantom:{N}", teachers="random:tiny", out=Path(out), n_aug=2, n_captions=2,
                store_size=64, shard_size=4, workers=0, batch_size=4, device="cpu", progress=False,
                source_options={"seed": SOURCE_SEED}, ray_retries=1)
    base.update(overrides)
    return BuildOptions(**base)


def tar_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.tar.gz"))}


def shard_stats(out: Path) -> dict[str, dict]:
    """Per-shard stats without the fields that time the writer."""
    return {p.name: {k: v for k, v in json.loads(p.read_text()).items() if k != "write_seconds"}
            for p in sorted((out / "stats").glob("shard-*.json"))}


def dataset_header(out: Path) -> dict:
    return {k: v for k, v in json.loads((out / "dataset.json").read_text()).items() if k != "build"}


def start_local_ray() -> None:
    init_ray(ray, num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False,
             log_to_driver=False, configure_logging=False)


def _drop_logged_tracebacks() -> None:
    """pytest keeps a test's log records (their text already formatted) until the test's next phase;
    the traceback of the error Ray Data logs for a failed build holds that build's actor pool."""
    for handler in {*logging.getLogger().handlers, *logging.getLogger("ray.data").handlers}:
        for record in getattr(handler, "records", ()):
            record.exc_info = None


def with_free_cpus(timeout: float = 20.0) -> None:
    """Ray with both CPUs free, as a fresh `reinforce build` process finds it. Ray Data releases a
    finished actor pool by reference counting; should one outlive its build (and hold the CPUs the
    next build waits for), Ray is restarted."""
    if ray.is_initialized():
        _drop_logged_tracebacks()
        gc.collect()
        deadline = time.monotonic() + timeout
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        if ray.available_resources().get("CPU", 0) >= 2:
            return
        ray.shutdown()
    start_local_ray()


@pytest.fixture(scope="module")
def ray_session():
    """One local 2-CPU Ray for the module (starting one takes seconds), shut down after it."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture()
def local_ray(ray_session):
    """The module's Ray, both CPUs free before each test."""
    with_free_cpus()
    return ray


@pytest.fixture(scope="module")
def damaged_jsonl(tmp_path_factory) -> tuple[Path, str]:
    """The 12 studies as a jsonl folder, one image damaged (found by the actor that reads it, not the source);
    (its jsonl, that record's id)."""
    from cxrdr.reinforce.phantom import write_phantom_dataset

    jsonl = write_phantom_dataset(N, tmp_path_factory.mktemp("data"), seed=SOURCE_SEED, size=64, progress=False)
    row = json.loads(jsonl.read_text().splitlines()[UNREADABLE])
    (jsonl.parent / row["image"]).write_bytes(b"\x89PNG not really")
    return jsonl, row["id"]


def jsonl_options(out, jsonl: Path, **overrides) -> BuildOptions:
    return options(out, source=f"jsonl:{jsonl}", source_options={}, **overrides)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, damaged_jsonl) -> Path:
    out = tmp_path_factory.mktemp("local") / "shards"
    build(jsonl_options(out, damaged_jsonl[0]))
    return out


def assert_same_build(out: Path, ref: Path) -> None:
    assert tar_bytes(ref) and tar_bytes(out) == tar_bytes(ref)  # byte-identical shards (and some)
    assert pq.read_table(out / "manifest.parquet").equals(pq.read_table(ref / "manifest.parquet"))
    assert shard_stats(out) == shard_stats(ref)
    assert dataset_header(out) == dataset_header(ref)
    assert verify(out)[0] == []


def test_failing_shards_are_named_the_others_complete_and_resume_retries_only_them(local_ray, reference,
                                                                                 damaged_jsonl, tmp_path, monkeypatch):
    """The failed build's shards and errors; its resume on two actors (a retried attempt, the damaged record logged
    with its id and reason); the resumed folder equal to the single-process build, byte for byte."""
    jsonl, damaged = damaged_jsonl
    out = tmp_path / "failing"
    monkeypatch.setenv(FAULTS_ENV, "1:5,2:5")  # every attempt at shards 1 and 2 raises
    with pytest.raises(UserError, match=r"2 shard\(s\) .* failed after 2 attempt\(s\) \(shard-000001.tar.gz: "
                                        r"RuntimeError: injected fault.*--resume"):
        build(jsonl_options(out, jsonl, engine="ray", ray_actors=1, ray_retries=1))
    assert [is_shard_complete(out, i) for i in range(4)] == [True, False, False, True]
    assert [json.loads(error_path(out, i).read_text())["attempt"] for i in (1, 2)] == [2, 2]
    assert not (out / "dataset.json").exists()
    kept = {i: (out / f"shard-{i:06d}.tar.gz").stat().st_mtime_ns for i in (0, 3)}

    with pytest.raises(UserError, match="--resume"):
        build(jsonl_options(out, jsonl, engine="ray"))
    monkeypatch.setenv(FAULTS_ENV, "1:1")  # attempts count per run: this run's first attempt raises, Ray retries it
    with_free_cpus()  # --resume is a new process: the failed build's actor pool must not hold the CPUs
    info = build(jsonl_options(out, jsonl, engine="ray", resume=True, ray_actors=2))
    rank = info["build"]["ranks"][0]
    assert rank["engine"] == "ray" and rank["actors"] == 2
    assert rank["shards_built"] == 2 and rank["shards_skipped_as_complete"] == 2
    assert sorted((s["index"], s["attempts"]) for s in rank["shards"]) == [(1, 2), (2, 1)]
    assert {i: (out / f"shard-{i:06d}.tar.gz").stat().st_mtime_ns for i in (0, 3)} == kept
    assert not error_path(out, 1).exists() and not error_path(out, 2).exists()
    skipped = {e["id"]: e["reason"] for e in info["skipped"]["build"]["records"]}
    assert list(skipped) == [damaged] and skipped[damaged].startswith("unreadable image")
    assert rank["skipped"]["records"] == info["skipped"]["build"]["records"]
    assert info["total_samples"] == N - 1
    assert_same_build(out, reference)  # the resumed folder is the single-process build, byte for byte


def test_a_local_ray_runs_its_workers_at_the_builds_priority(local_ray):
    """Ray nices its workers (15) unless told otherwise; the build's local Ray does not, so its actors keep their
    share of the cores beside other work."""
    assert local_ray.get(local_ray.remote(lambda: os.nice(0)).remote()) == 0


def test_a_cluster_at_ray_address_keeps_its_own_settings(monkeypatch):
    calls = []
    fake = type("FakeRay", (), {"init": staticmethod(lambda **kw: calls.append(kw))})
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    init_ray(fake, include_dashboard=False)
    monkeypatch.delenv("RAY_ADDRESS")
    init_ray(fake, include_dashboard=False)
    assert calls == [{"include_dashboard": False},
                     {"include_dashboard": False, "_system_config": {"worker_niceness": 0}}]


def test_engine_ray_flags_are_checked_before_any_work(tmp_path):
    with pytest.raises(UserError, match="--engine ray schedules the shards itself"):
        build(options(tmp_path / "x", engine="ray", world_size=2, rank=0))
    with pytest.raises(UserError, match="--engine must be local or ray"):
        build(options(tmp_path / "x", engine="spark"))
    with pytest.raises(UserError, match="--ray-actors must be >= 1"):
        build(options(tmp_path / "x", engine="ray", ray_actors=0))
    assert not (tmp_path / "x").exists()
    assert not stats_path(tmp_path / "x", 0).exists()


def test_engine_ray_without_ray_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(UserError, match=r'--engine ray needs Ray Data.*pip install "cxrdr\[ray\]"'):
        build(options(tmp_path / "x", engine="ray"))
    assert not (tmp_path / "x").exists()
