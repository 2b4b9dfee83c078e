"""The build's writer thread (cxrdr.reinforce.writer.BackgroundWriter, fed by pipeline.run_shards):
same shard bytes as writing in turn, a writer failure raised in the build naming the shard and its
cause without hanging (also with the queue full), a failure of the main loop stopping the writer
thread with the queued shards complete and nothing half-written; and the throughput benchmark's
steady-state figures.

Tiny data: phantom:N builds with the random:tiny teacher, no DataLoader workers.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import pytest

from cxrdr.reinforce import build as build_module
from cxrdr.reinforce import pipeline
from cxrdr.reinforce.build import build
from cxrdr.reinforce.writer import BackgroundWriter, ShardFile, WriterFailed, is_shard_complete
from tests.test_faults import tiny_build_options
from tests.script_loader import load_script

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_teacher():
    from cxrdr.teachers import load_teachers

    return load_teachers("random:tiny", device="cpu")


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shard-writer"]


def shard_files(out: Path) -> dict[str, bytes]:
    """Every tar's bytes, and every shard stats file without its timing (``write_seconds``)."""
    files = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.tar*"))}
    for p in sorted((out / "stats").glob("shard-*.json")):
        stats = json.loads(p.read_text())
        stats.pop("write_seconds")
        files[f"stats/{p.name}"] = json.dumps(stats, sort_keys=True).encode()
    return files


@pytest.mark.timeout(120)
@pytest.mark.parametrize("emb_dtype", ["float16", "int8"])
def test_overlapped_writes_give_the_bytes_of_serial_writes(tmp_path, tiny_teacher, monkeypatch, emb_dtype):
    """Batches of 4 records over shards of 3 (batches cross shard ends), int8 too (its quality stats are
    gathered in the writer thread): every tar and stats file equals the serial build's."""
    threaded = []
    real = pipeline.BackgroundWriter

    def spy(*args, **kwargs):
        threaded.append(kwargs.get("threaded", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "BackgroundWriter", spy)
    opts = functools.partial(tiny_build_options, source="phantom:11", emb_dtype=emb_dtype)
    info = build(opts(tmp_path / "overlap"), teachers=tiny_teacher)
    with monkeypatch.context() as patch:
        patch.setattr(build_module, "run_shards", functools.partial(pipeline.run_shards, overlap_writes=False))
        build(opts(tmp_path / "serial"), teachers=tiny_teacher)
    assert threaded == [True, False]
    overlap, serial = shard_files(tmp_path / "overlap"), shard_files(tmp_path / "serial")
    assert len(overlap) == 2 * 4 and list(overlap) == list(serial)  # 11 records: 4 shards, tar + stats each
    for name in overlap:
        assert overlap[name] == serial[name], name
    if emb_dtype == "int8":
        assert json.loads(overlap["stats/shard-000000.json"])["int8_min_cosine"]["random-tiny"] > 0.9
    rank = info["build"]["ranks"][0]
    assert set(rank["time_split_seconds"]) == set(pipeline.TIMING_KEYS)
    assert rank["time_split_seconds"]["write"] > 0 and rank["time_split_seconds"]["write_wait"] >= 0
    assert rank["assemble_seconds"] > 0 and rank["main_cpu_seconds"]["assemble"] >= 0
    assert 0 < rank["first_batch_seconds"] <= rank["pipeline_seconds"]
    assert not writer_threads()


@pytest.mark.timeout(60)
def test_a_writer_failure_stops_the_build_naming_the_shard_and_its_cause(tmp_path, tiny_teacher, monkeypatch):
    """A full disk on shard 1: the build raises at once (queue of one batch, the writer slow before it
    fails, so the main thread waits on a full queue), the cause chained; shard 0 complete, no temp file."""
    real_add = ShardFile.add

    def add(self, sample, row):
        if self.index == 1:
            time.sleep(0.3)  # meanwhile the main thread fills the queue and blocks on it
            raise OSError(28, "No space left on device")
        real_add(self, sample, row)

    monkeypatch.setattr(ShardFile, "add", add)
    monkeypatch.setattr(pipeline, "WRITER_QUEUE_BATCHES", 1)
    out = tmp_path / "full"
    started = time.monotonic()
    with pytest.raises(WriterFailed, match=r"shard writer failed on shard-000001\.tar\.gz: OSError: .*No space left") \
            as excinfo:
        build(tiny_build_options(out, source="phantom:24", batch_size=1), teachers=tiny_teacher)
    assert time.monotonic() - started < 30
    assert isinstance(excinfo.value.__cause__, OSError) and excinfo.value.__cause__.errno == 28
    assert [i for i in range(30) if is_shard_complete(out, i)] == [0]
    assert not list(out.rglob("*.tmp*")) and not (out / "dataset.json").exists()
    assert not writer_threads()


@pytest.mark.timeout(60)
def test_the_writer_thread_failing_with_a_full_queue_does_not_hang_the_main_thread(tmp_path):
    """The writer blocked on a sample while the main thread waits on the full queue, then failing: the
    main thread's wait ends with the failure, and abort joins the thread."""
    writer = BackgroundWriter(tmp_path, maxsize=1, compression="none")
    release = threading.Event()

    def stuck_sample():
        release.wait(10)
        raise ValueError("cannot encode this sample")

    writer.begin(0, "train", 3)
    writer.add(stuck_sample, {"key": "a"})
    writer.flush()  # taken by the writer, which blocks in it
    deadline = time.monotonic() + 5
    while writer.queue.qsize() or not writer._current:  # the writer holds the first item
        assert time.monotonic() < deadline
        time.sleep(0.01)
    writer.skip("b", "unreadable image")
    writer.flush()  # fills the queue (one item)
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    with pytest.raises(WriterFailed, match="shard-000000.tar: ValueError: cannot encode this sample") as excinfo:
        writer.skip("c", "unreadable image")
        writer.flush()  # blocks on the full queue until the writer fails, then raises
        writer.close()
    assert 0.2 < time.monotonic() - started < 10
    assert isinstance(excinfo.value.__cause__, ValueError)
    writer.abort()
    assert not writer._thread.is_alive() and not writer_threads()
    assert not list(tmp_path.iterdir())  # the shard's temp tar is gone


@pytest.mark.timeout(60)
def test_abort_with_a_full_queue_completes_the_queued_shards_and_joins(tmp_path):
    """The main loop failing while the (slow) writer's queue is full: abort waits for room instead of
    giving up (which left the thread waiting forever), the complete shard queued is written, the
    incomplete one dropped, the thread joined."""
    writer = BackgroundWriter(tmp_path, maxsize=1, compression="none")
    release = threading.Event()

    def slow_sample():
        release.wait(10)
        return {"__key__": "a", "txt": b"report a"}

    writer.begin(0, "train", 1)
    writer.add(slow_sample, {"key": "a"})
    writer.end({"teachers": []})
    writer.flush()
    deadline = time.monotonic() + 5
    while writer.queue.qsize() or not writer._current:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    writer.begin(1, "train", 2)
    writer.add({"__key__": "b", "txt": b"report b"}, {"key": "b"})
    writer.flush()  # the queue is full now
    threading.Timer(0.3, release.set).start()
    writer.abort()
    assert not writer._thread.is_alive() and writer.error is None
    assert is_shard_complete(tmp_path, 0) and not is_shard_complete(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.tar", "stats"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [RuntimeError("teacher died"), KeyboardInterrupt()])
def test_a_failure_in_the_main_loop_stops_the_writer_thread(tmp_path, tiny_teacher, monkeypatch, error):
    """The teacher raising at its third batch (Ctrl-C too): the error reaches the caller as it is, the
    writer thread is gone, the shards queued before it are complete and nothing is half-written."""
    real = pipeline.queue_batch
    calls = []

    def embed(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "queue_batch", embed)
    out = tmp_path / "shards"
    with pytest.raises(type(error)):
        build(tiny_build_options(out, source="phantom:12"), teachers=tiny_teacher)
    assert not writer_threads()
    # batches of 4 over shards of 3: the 8 records embedded complete shards 0 and 1; shard 2 is dropped
    assert [i for i in range(4) if is_shard_complete(out, i)] == [0, 1]
    assert not list(out.rglob("*.tmp*"))


@pytest.mark.timeout(120)
def test_throughput_benchmark_reports_the_steady_state(tmp_path):
    bench = load_script("benchmarks/reinforce_throughput.py")
    profile = tmp_path / "profile.txt"
    m = bench.measure(n=6, teachers="random:tiny", workers=0, batch_size=2, n_aug=2, n_captions=2, store_size=48,
                      device="cpu", out=str(tmp_path), teacher_repeats=1, profile_out=str(profile))
    assert m["ratio"] == m["build_samples_per_s"] / m["teacher_samples_per_s"]
    # --profile-out: the build's own thread and its writer thread sampled, each with the functions on its stack
    sections = profile.read_text().split("==== thread ")[1:]
    by_thread = {section.split(" [")[0]: section for section in sections}  # "name [ident]: ..."
    assert {threading.current_thread().name, "shard-writer"} <= set(by_thread)
    assert "run_shards (pipeline.py" in by_thread[threading.current_thread().name]
    assert "BackgroundWriter._run (writer.py" in by_thread["shard-writer"]
    assert "thread-sampler" not in by_thread and "thread-sampler" not in {t.name for t in threading.enumerate()}
    assert 0 < m["build_steady_seconds"] <= m["build_seconds"]
    assert m["build_steady_samples_per_s"] == m["samples"] / m["build_steady_seconds"] >= m["build_samples_per_s"]
    assert m["steady_ratio"] == m["build_steady_samples_per_s"] / m["teacher_samples_per_s"]
    assert "write_wait" in m["time_split_seconds"]


def teacher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("teacher")]


@pytest.mark.timeout(120)
def test_teachers_in_an_embedding_thread_give_the_bytes_of_the_build_in_turn(tmp_path, tiny_teacher, monkeypatch):
    """``overlap_teachers`` (the default with CUDA teachers), forced here on the CPU: each batch is embedded in
    one thread while the next is loaded; every tar and stats file equals the build's in turn, and a failure
    in a forward stops the build with the shards before it complete and no thread left behind."""
    opts = functools.partial(tiny_build_options, source="phantom:11", batch_size=2)
    with monkeypatch.context() as patch:
        patch.setattr(build_module, "run_shards", functools.partial(pipeline.run_shards, overlap_teachers=True))
        build(opts(tmp_path / "threaded"), teachers=tiny_teacher)
    build(opts(tmp_path / "in-turn"), teachers=tiny_teacher)
    threaded, in_turn = shard_files(tmp_path / "threaded"), shard_files(tmp_path / "in-turn")
    assert len(threaded) == 2 * 4 and list(threaded) == list(in_turn)
    for name in threaded:
        assert threaded[name] == in_turn[name], name
    assert not teacher_threads()

    # pipelined: each batch's rows are waited for once the next batch's forwards are queued (the GPU never waits
    # for this process between batches); the last one at the end
    events, queue, result = [], pipeline.queue_batch, pipeline.QueuedBatch.result

    def queued(*args, **kwargs):
        events.append("queue")
        return queue(*args, **kwargs)

    def waited(self):
        events.append("result")
        return result(self)

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "queue_batch", queued)
        patch.setattr(pipeline.QueuedBatch, "result", waited)
        patch.setattr(build_module, "run_shards", functools.partial(pipeline.run_shards, overlap_teachers=True))
        build(opts(tmp_path / "pipelined"), teachers=tiny_teacher)
    assert events == ["queue"] + ["queue", "result"] * 5 + ["result"]  # 11 records in batches of 2: 6 batches
    assert shard_files(tmp_path / "pipelined") == in_turn

    # the loader failing after three batches: the batch in hand, embedded, still completes its shard
    regroup = pipeline._regroup

    def three_batches_then_a_failure(*args, **kwargs):
        for i, collated in enumerate(regroup(*args, **kwargs)):
            if i == 3:
                raise OSError("unreadable shard source")
            yield collated

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "_regroup", three_batches_then_a_failure)
        patch.setattr(build_module, "run_shards", functools.partial(pipeline.run_shards, overlap_teachers=True))
        with pytest.raises(OSError, match="unreadable"):
            build(opts(tmp_path / "loader-failed"), teachers=tiny_teacher)
    assert [i for i in range(4) if is_shard_complete(tmp_path / "loader-failed", i)] == [0, 1]  # 6 records
    assert not teacher_threads() and not writer_threads()

    real = pipeline.queue_batch
    calls = []

    def fail_on_the_fourth_batch(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "queue_batch", fail_on_the_fourth_batch)
    monkeypatch.setattr(build_module, "run_shards", functools.partial(pipeline.run_shards, overlap_teachers=True))
    out = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        build(opts(out), teachers=tiny_teacher)
    assert all(name.startswith("teacher") for name in calls)
    assert [i for i in range(4) if is_shard_complete(out, i)] == [0, 1]  # batches 1-3 (6 records): shards of 3
    assert not list(out.rglob("*.tmp*")) and not teacher_threads() and not writer_threads()
