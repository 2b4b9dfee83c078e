"""Shard writing: one tar per shard under a temp name, renamed with its stats file when complete.

A shard is *complete* when both ``shard-NNNNNN.tar[.gz]`` and ``stats/shard-NNNNNN.json`` exist and
the tar's size equals the size recorded in the stats (``is_shard_complete``). Everything else
(a ``.tmp`` tar left by a killed build, a tar without stats) is rebuilt by ``--resume``.

The per-shard stats file carries the shard's manifest rows, bytes per part and skipped records,
so ``reinforce merge`` never has to reopen the tars.

``BackgroundWriter`` packs the samples and writes the tars in one thread fed through a bounded
queue, so the teacher forwards in the main process never wait for the disk or the packing (and
the disk never waits for a forward); the bytes are those of writing in the calling thread.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path

from cxrdr.common.atomic import write_json_atomic
from cxrdr.common.checksums import checksum_record, member_checksums
from cxrdr.common.shards import part_of, shard_name, shard_stats_path
from cxrdr.reinforce.gzip_stream import ParallelGzipWriter

TMP_SUFFIX = ".tmp"
GZIP_LEVEL = 1


def stats_path(out_dir: Path, index: int) -> Path:
    return shard_stats_path(out_dir, index)


def read_shard_stats(out_dir: Path, index: int) -> dict:
    return json.loads(stats_path(out_dir, index).read_text())


def is_shard_complete(out_dir: Path, index: int) -> bool:
    """True when the shard's tar (named in its stats) and stats were both renamed into place and
    agree on size."""
    try:
        stats = read_shard_stats(out_dir, index)
        tar = Path(out_dir) / stats["name"]
        return tar.is_file() and stats.get("tar_bytes") == tar.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return False


class TarOut:
    """A webdataset TarWriter onto an open file, through a gzip stream when ``compression`` is gzip.

    Our own gzip stream, not ``TarWriter(compress=True)`` (tarfile's "w|gz" stamps the time and the file
    name into the gzip header): mtime 0 and no name, so identical inputs give identical bytes, deflated on a
    thread pool (``gzip_stream``) rather than in the writer thread. Level 1: the headers and padding it exists
    to remove shrink as much as at level 9, and JPEG and float16 payloads hardly compress at any level.
    """

    def __init__(self, file, compression: str):
        import webdataset as wds

        self._gzip = ParallelGzipWriter(file, GZIP_LEVEL) if compression == "gzip" else None
        # mtime=0 and no encoder: byte-identical tars for identical inputs (resume == fresh build).
        self._tar = wds.TarWriter(self._gzip or file, encoder=False, mtime=0)

    def write(self, sample: dict) -> None:
        self._tar.write(sample)

    def close(self) -> None:
        """End the tar (and the gzip stream); the file itself stays open."""
        try:
            self._tar.close()
        finally:
            if self._gzip is not None:
                self._gzip.close()


class ShardFile:
    """One shard being written to ``shard-NNNNNN.tar[.gz].tmp``."""

    def __init__(self, out_dir: Path, index: int, split: str, records: int, compression: str = "gzip"):
        self.out_dir, self.index, self.split, self.records = Path(out_dir), index, split, records
        self.path = self.out_dir / shard_name(index, compression)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self._file = open(self.tmp, "wb")
        self._tar = TarOut(self._file, compression)
        self.rows: list[dict] = []
        self.bytes: dict[str, int] = {}
        self.skipped: list[dict] = []
        self.checksums: dict[str, dict[str, str]] = {}  # key -> {ext: crc32}, checked by verify
        self.write_seconds = 0.0

    def add(self, sample: dict, row: dict) -> None:
        start = time.perf_counter()
        self._tar.write(sample)
        self.checksums[sample["__key__"]] = member_checksums(sample)
        for ext, value in sample.items():
            if not ext.startswith("__"):
                self.bytes[part_of(ext)] = self.bytes.get(part_of(ext), 0) + len(value)
        self.rows.append(row)
        self.write_seconds += time.perf_counter() - start

    def skip(self, record_id: str, reason: str) -> None:
        self.skipped.append({"id": record_id, "reason": reason})

    def finish(self, extra: dict | None = None) -> dict:
        """Close, fsync and rename the tar, then write its stats (the completion marker)."""
        start = time.perf_counter()
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        self.write_seconds += time.perf_counter() - start
        stats = {"name": self.path.name, "index": self.index, "split": self.split,
                 "records": self.records, "samples": len(self.rows),
                 "tar_bytes": self.path.stat().st_size, "bytes": self.bytes,
                 "skipped": self.skipped, "write_seconds": round(self.write_seconds, 4),
                 **(extra or {}), "checksums": checksum_record(self.checksums), "rows": self.rows}
        write_json_atomic(stats_path(self.out_dir, self.index), stats, indent=None)
        return stats

    def abort(self) -> None:
        """Drop a half-written shard (a killed build leaves the same ``.tmp``; resume redoes it)."""
        try:
            with contextlib.suppress(Exception):  # end the gzip stream before its file goes (no close at GC)
                self._tar.close()
            self._file.close()
        finally:
            self.tmp.unlink(missing_ok=True)


class WriterFailed(RuntimeError):
    """The shard writer thread failed; ``__cause__`` is its original exception."""


class BackgroundWriter:
    """Writes the shards in order, in one thread fed through a small bounded queue.

    The main thread calls ``begin``, ``add``/``skip``..., ``end`` per shard, then ``flush`` once per
    teacher batch: the batch's operations travel as one queue item (``maxsize`` items, so at most
    that many batches wait and memory stays flat). ``add`` takes the sample or a zero-argument
    callable that makes it, and ``end`` its extra stats or a callable: those run in the writer
    thread, so packing the samples (``assemble_sample``) overlaps the next batch's loading and
    teacher forward too.

    Why a thread: the work is encoding (numpy, zlib) and file writes, which release the GIL for
    their bulk, and a process would have to pickle every batch's images and embeddings to reach
    it. One thread, consuming in order: the tars are the same bytes as written serially
    (``threaded=False`` writes in the calling thread, the reference the tests compare against).

    A failure in the thread (a full disk, a bad sample, ``on_shard_done`` raising) drops the shard in
    progress and is raised in the main thread as :class:`WriterFailed` (naming the shard and chaining
    the original) by the next ``flush`` or by ``close``; the thread keeps taking queue items without
    writing them, so the main thread never blocks on a full queue. ``abort`` (the main loop failed)
    writes what was queued, drops the shard left incomplete and joins the thread.

    Timing: ``write_seconds`` (tar writing, fsync, rename: the ShardFiles' own seconds),
    ``assemble_seconds`` / ``assemble_cpu_seconds`` (the callables, in the thread), ``wait_seconds``
    (the main thread blocked on a full queue, and in ``close`` until the last shard is written).
    """

    def __init__(self, out_dir: Path, maxsize: int = 4, on_shard_done=None, compression: str = "gzip",
                 threaded: bool = True):
        self.out_dir = Path(out_dir)
        self.compression = compression
        self.on_shard_done = on_shard_done  # called in the writer thread with the stats dict
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.error_at: str | None = None  # the shard the writer was on when it failed
        self.completed: list[dict] = []
        self.write_seconds = 0.0
        self.assemble_seconds = 0.0
        self.assemble_cpu_seconds = 0.0
        self.wait_seconds = 0.0
        self._pending: list[tuple] = []
        self._current: ShardFile | None = None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True) if threaded else None
        if self._thread is not None:
            self._thread.start()

    # main-thread side -------------------------------------------------------------------
    def begin(self, index: int, split: str, records: int) -> None:
        self._pending.append(("begin", index, split, records))

    def add(self, sample, row: dict) -> None:
        """``sample``: the tar members, or a callable returning them (called in the writer thread)."""
        self._pending.append(("add", sample, row))

    def skip(self, record_id: str, reason: str) -> None:
        self._pending.append(("skip", record_id, reason))

    def end(self, extra=None) -> None:
        """``extra``: stats to add, or a callable returning them (called in the writer thread)."""
        self._pending.append(("end", extra))

    def flush(self) -> None:
        """Queue the operations given since the last flush as one item; raises a writer failure."""
        self._raise_if_failed()
        if self._pending:
            ops, self._pending = self._pending, []
            self._put(ops)
        self._raise_if_failed()

    def close(self) -> None:
        """Wait until everything queued is written and stop the thread; raises a writer failure."""
        self.flush()
        if self._thread is not None:
            start = time.perf_counter()
            self._put(None)
            self._thread.join()
            self.wait_seconds += time.perf_counter() - start
        self._raise_if_failed()

    def abort(self) -> None:
        """The main loop failed: write what was queued (its complete shards), drop the incomplete
        shard's temp file and stop the thread. Never raises a writer failure (the caller is raising)."""
        ops, self._pending = self._pending, []
        if self._thread is not None and not self._thread.is_alive():
            return  # closed already (or never ran): nothing to stop
        if self._thread is None:
            self._handle_item(ops + [("abort",)])
            return
        if ops:
            self._put(ops, check=False)
        self._put([("abort",)], check=False)
        self._thread.join()

    def _put(self, item, check: bool = True) -> None:
        if self._thread is None:
            if item is not None:
                self._handle_item(item)
            return
        start = time.perf_counter()
        try:
            while True:
                if check:
                    self._raise_if_failed()
                if not self._thread.is_alive():  # gone without a recorded error: nothing will take the item
                    if check:
                        raise WriterFailed("shard writer thread is not running")
                    return
                try:
                    self.queue.put(item, timeout=0.2)
                    return
                except queue.Full:
                    continue
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            where = f" on {self.error_at}" if self.error_at else ""
            raise WriterFailed(f"shard writer failed{where}: {type(self.error).__name__}: {self.error}") \
                from self.error

    # writer-thread side -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None or self._handle_item(item):
                return

    def _handle_item(self, ops: list) -> bool:
        """Carry out one batch's operations; True at ``abort``. After a failure only ``abort`` acts
        (the items are still taken, so the main thread never waits on a full queue)."""
        for op in ops:
            if op[0] == "abort":
                self._drop_current()
                return True
            if self.error is not None:
                continue
            try:
                self._handle(op)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.error = exc
                self._drop_current()
        return False

    def _drop_current(self) -> None:
        """Remove the shard in progress (its temp file), as a killed build would leave it for resume."""
        shard, self._current = self._current, None
        if shard is None:
            return
        try:
            shard.abort()
        except Exception as exc:  # noqa: BLE001 - a failure is being handled already; keep the first
            self.error = self.error or exc

    def _handle(self, op) -> None:
        kind = op[0]
        if kind == "begin":
            self.error_at = shard_name(op[1], self.compression)
            self._current = ShardFile(self.out_dir, *op[1:], compression=self.compression)
        elif kind == "add":
            sample = op[1]
            if callable(sample):
                start, cpu = time.perf_counter(), time.thread_time()
                sample = sample()
                self.assemble_seconds += time.perf_counter() - start
                self.assemble_cpu_seconds += time.thread_time() - cpu
            self._current.add(sample, op[2])
        elif kind == "skip":
            self._current.skip(op[1], op[2])
        elif kind == "end":
            extra = op[1]() if callable(op[1]) else op[1]
            stats = self._current.finish(extra)  # raising, the shard is still current: dropped
            self.write_seconds += self._current.write_seconds
            self._current = None
            self.completed.append(stats)
            if self.on_shard_done is not None:
                self.on_shard_done(stats)
