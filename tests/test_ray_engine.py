"""`reinforce build --engine ray` on a local Ray instance (2 CPUs): the same shard folder as the
single-process build, resume by shard, retries, failed shards named, skipped records logged.

Tiny builds: phantom:12, K=2, S=2, 64 px, random:tiny teacher, shards of 4 records. Each Ray build starts
an actor pool (seconds on two cores), so the tests share builds: three in all.
"""
from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cxrdr.reinforce.build import BuildOptions, build
from cxrdr.common.errors import UserError
from cxrdr.reinforce.ray_engine import FAULTS_ENV, error_path
from cxrdr.reinforce.verify import verify
from cxrdr.reinforce.writer import is_shard_complete, stats_path

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

N = 12
SOURCE_SEED = 4  # the first 12 studies span train, val and test: shards never mix splits


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
    ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False,
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
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "shards"
    build(options(out))
    return out


def assert_same_build(out: Path, ref: Path) -> None:
    assert tar_bytes(ref) and tar_bytes(out) == tar_bytes(ref)  # byte-identical shards (and some)
    assert pq.read_table(out / "manifest.parquet").equals(pq.read_table(ref / "manifest.parquet"))
    assert shard_stats(out) == shard_stats(ref)
    assert dataset_header(out) == dataset_header(ref)
    assert verify(out)[0] == []


def test_a_failing_shard_is_named_the_others_complete_and_resume_retries_only_it(local_ray, reference, tmp_path,
                                                                               monkeypatch):
    out = tmp_path / "failing"
    monkeypatch.setenv(FAULTS_ENV, "1:5")  # every attempt at shard 1 raises
    with pytest.raises(UserError, match=r"1 shard\(s\) .* failed after 2 attempt\(s\) \(shard-000001.tar.gz: "
                                        r"RuntimeError: injected fault.*--resume"):
        build(options(out, engine="ray", ray_actors=1, ray_retries=1))
    assert [is_shard_complete(out, i) for i in range(4)] == [True, False, True, True]
    assert json.loads(error_path(out, 1).read_text())["attempt"] == 2
    assert not (out / "dataset.json").exists()
    kept = {i: (out / f"shard-{i:06d}.tar.gz").stat().st_mtime_ns for i in (0, 2, 3)}

    with pytest.raises(UserError, match="--resume"):
        build(options(out, engine="ray"))
    monkeypatch.setenv(FAULTS_ENV, "1:1")  # attempts count per run: this run's first attempt raises, Ray retries it
    with_free_cpus()  # --resume is a new process: the failed build's actor pool must not hold the CPUs
    info = build(options(out, engine="ray", resume=True, ray_actors=1))
    rank = info["build"]["ranks"][0]
    assert rank["shards_built"] == 1 and rank["shards_skipped_as_complete"] == 3
    assert [(s["index"], s["attempts"]) for s in rank["shards"]] == [(1, 2)]
    assert {i: (out / f"shard-{i:06d}.tar.gz").stat().st_mtime_ns for i in (0, 2, 3)} == kept
    assert not error_path(out, 1).exists()
    assert_same_build(out, reference)  # the resumed folder is the single-process build, byte for byte


def test_ray_build_equals_the_local_build_and_logs_unreadable_images_with_id_and_reason(local_ray, tmp_path):
    from cxrdr.reinforce.phantom import write_phantom_dataset

    jsonl = write_phantom_dataset(6, tmp_path / "data", size=64, progress=False)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    (jsonl.parent / rows[1]["image"]).write_bytes(b"\x89PNG not really")  # found by the actor, not the source
    kw = dict(source=f"jsonl:{jsonl}", source_options={}, shard_size=3)
    info = build(options(tmp_path / "ray", engine="ray", ray_actors=2, **kw))
    build(options(tmp_path / "local", **kw))
    skipped = {e["id"]: e["reason"] for e in info["skipped"]["build"]["records"]}
    assert list(skipped) == [rows[1]["id"]] and skipped[rows[1]["id"]].startswith("unreadable image")
    rank = info["build"]["ranks"][0]
    assert rank["skipped"]["records"] == info["skipped"]["build"]["records"]
    assert rank["engine"] == "ray" and rank["actors"] == 2 and rank["shards_built"] == 2
    assert sorted(s["index"] for s in rank["shards"]) == [0, 1] and info["total_samples"] == 5
    assert_same_build(tmp_path / "ray", tmp_path / "local")


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
