"""Shard writing: one tar per shard under a temp name, renamed with its stats file when complete.

A shard is *complete* when both ``shard-NNNNNN.tar[.gz]`` and ``stats/shard-NNNNNN.json`` exist and
the tar's size equals the size recorded in the stats (``is_shard_complete``). Everything else
(a ``.tmp`` tar left by a killed build, a tar without stats) is rebuilt by ``--resume``.

The per-shard stats file carries the shard's manifest rows, bytes per part and skipped records,
so ``reinforce merge`` never has to reopen the tars.

``BackgroundWriter`` runs the tar writing in a thread fed through a bounded queue, so teacher
forwards in the main process never wait for the disk (and the disk never waits for a forward).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import queue
import threading
import time
from pathlib import Path

from cxrdr.common.checksums import checksum_record, member_checksums
from cxrdr.common.shards import part_of, shard_name, shard_stats_path

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


def write_json_atomic(path: Path, data, indent: int | None = 1) -> None:
    """Write JSON to ``path`` through a temp file + fsync + rename (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f"{TMP_SUFFIX}{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=indent, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to ``path`` through a temp file + rename (readers never see half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + f"{TMP_SUFFIX}{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class TarOut:
    """A webdataset TarWriter onto an open file, through a gzip stream when ``compression`` is gzip.

    Our own GzipFile, not ``TarWriter(compress=True)`` (tarfile's "w|gz" stamps the time and the file
    name into the gzip header): mtime 0 and no name, so identical inputs give identical bytes. Level 1:
    the headers and padding it exists to remove shrink as much as at level 9, and JPEG and float16
    payloads hardly compress at any level.
    """

    def __init__(self, file, compression: str):
        import webdataset as wds

        self._gzip = (gzip.GzipFile(fileobj=file, mode="wb", compresslevel=GZIP_LEVEL, mtime=0, filename="")
                      if compression == "gzip" else None)
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


class BackgroundWriter:
    """Feeds ShardFiles from a thread. Messages arrive in order: begin, add/skip..., end."""

    def __init__(self, out_dir: Path, maxsize: int = 64, on_shard_done=None, compression: str = "gzip"):
        self.out_dir = Path(out_dir)
        self.compression = compression
        self.on_shard_done = on_shard_done  # called in the writer thread with the stats dict
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.completed: list[dict] = []
        self.write_seconds = 0.0
        self._current: ShardFile | None = None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    # main-thread side -------------------------------------------------------------------
    def _put(self, message) -> None:
        while True:
            self._raise_if_failed()
            try:
                self.queue.put(message, timeout=0.5)
                return
            except queue.Full:
                continue

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"shard writer failed: {self.error}") from self.error

    def begin(self, index: int, split: str, records: int) -> None:
        self._put(("begin", index, split, records))

    def add(self, sample: dict, row: dict) -> None:
        self._put(("add", sample, row))

    def skip(self, record_id: str, reason: str) -> None:
        self._put(("skip", record_id, reason))

    def end(self, extra: dict | None = None) -> None:
        self._put(("end", extra))

    def close(self) -> None:
        """Wait until everything queued is written; re-raise a writer error here."""
        self._put(None)
        self._thread.join()
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop without completing the shard in progress (its temp file is removed)."""
        try:
            self.queue.put(("abort",), timeout=5)
        except queue.Full:
            pass
        self._thread.join(timeout=30)

    # writer-thread side -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            message = self.queue.get()
            if message is None:
                return
            if message[0] == "abort":
                if self._current is not None:
                    self._current.abort()
                    self._current = None
                return
            if self.error is not None:
                continue  # keep draining so the main thread never blocks on a full queue
            try:
                self._handle(message)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.error = exc
                if self._current is not None:
                    self._current.abort()
                    self._current = None

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "begin":
            self._current = ShardFile(self.out_dir, *message[1:], compression=self.compression)
        elif kind == "add":
            self._current.add(message[1], message[2])
        elif kind == "skip":
            self._current.skip(message[1], message[2])
        elif kind == "end":
            stats = self._current.finish(message[1])
            self.write_seconds += self._current.write_seconds
            self._current = None
            self.completed.append(stats)
            if self.on_shard_done is not None:
                self.on_shard_done(stats)
