"""A gzip stream whose deflate runs on a thread pool, for the shard writer.

Why: on the H100 at 416dba0 the build's writer thread was busy 2.6 s of a 5.4 s build and the embedding thread
waited 1.3 s for its queue (docs/gpu.md, "Fourth H100 session"); on this CPU three quarters of that thread's time
is ``GzipFile.write``. Python's gzip deflates in the calling thread, one stream at a time. Concatenated gzip
members would let threads compress parts apart, but ``tarfile``'s stream mode (``r|gz``, which webdataset reads
shards with) stops at the first member. So the stream is cut pigz's way: each ``CHUNK`` bytes of input is
deflated by its own raw compressor on a few threads (zlib releases the GIL while it deflates) and ended with a sync
flush, which leaves the deflate stream byte-aligned with no final block, so the chunks' outputs concatenate into
one deflate stream; the last chunk finishes it, and the writer adds one gzip header and trailer (CRC-32 and size
of the whole input). One gzip member, any gzip reader, and the same bytes for the same input whatever the threads'
timing or how the input was split into ``write`` calls.
"""
from __future__ import annotations

import collections
import os
import struct
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

CHUNK = 256 * 1024  # input bytes a compressor takes; each starts with an empty dictionary (~1 % on JSON and text)
# mtime 0, extra flags 4 (fastest), OS 255 (unknown): no time or machine in the bytes
HEADER = b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + b"\x04\xff"
THREADS = min(4, os.cpu_count() or 1)


def _deflate(data: bytes, level: int, last: bool) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)  # raw deflate: the header is ours
    return compressor.compress(data) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


class ParallelGzipWriter:
    """Write-only file object: ``write`` bytes, ``close`` ends the gzip stream (the file ``fileobj`` stays open).
    At most ``in_flight`` chunks are deflating at once; their outputs reach ``fileobj`` in order. The stream's own
    threads (up to THREADS, started as chunks come) end with it: none is left to a process that forks later (the
    loader workers of a training run after a build in the same process)."""

    def __init__(self, fileobj, level: int, in_flight: int = 8):
        self._file, self._level, self._in_flight = fileobj, level, in_flight
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gzip")
        self._buffer = bytearray()
        self._pending: collections.deque[Future] = collections.deque()
        self._crc, self._size, self.closed = 0, 0, False
        self._file.write(HEADER)

    def write(self, data) -> int:
        if self.closed:
            raise ValueError("write to a closed gzip stream")
        data = memoryview(data).cast("B")
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)
        self._buffer += data
        while len(self._buffer) > CHUNK:  # '>': the last chunk, finished at close, is never empty
            chunk, self._buffer = bytes(self._buffer[:CHUNK]), self._buffer[CHUNK:]
            self._submit(chunk, last=False)
        return len(data)

    def _submit(self, chunk: bytes, last: bool) -> None:
        self._pending.append(self._pool.submit(_deflate, chunk, self._level, last))
        while len(self._pending) > (0 if last else self._in_flight - 1):
            self._file.write(self._pending.popleft().result())

    def flush(self) -> None:  # tarfile's stream flushes its file object; chunks go out whole
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._submit(bytes(self._buffer), last=True)  # waits for every chunk, in order
            self._buffer = bytearray()
            self._file.write(struct.pack("<II", self._crc, self._size & 0xFFFFFFFF))
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
