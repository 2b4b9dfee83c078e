"""cxrdr/reinforce/gzip_stream.py: the shard writer's gzip stream, deflated chunk by chunk on a thread pool, is one
gzip member that every reader (gzip, tarfile's stream mode as webdataset uses it) reads back whole, and the same
bytes for the same input however it was written."""
from __future__ import annotations

import gzip
import io
import random
import tarfile
import threading
import zlib

import pytest

from cxrdr.reinforce import gzip_stream
from cxrdr.reinforce.gzip_stream import ParallelGzipWriter


def _compressed(data: bytes, pieces: list[int], level: int = 1) -> bytes:
    out = io.BytesIO()
    stream = ParallelGzipWriter(out, level, in_flight=3)
    start = 0
    for size in pieces:
        assert stream.write(data[start:start + size]) == len(data[start:start + size])
        start += size
    stream.write(data[start:])
    stream.close()
    stream.close()  # a second close does nothing
    return out.getvalue()


@pytest.mark.parametrize("size", [0, 1, gzip_stream.CHUNK - 1, gzip_stream.CHUNK, gzip_stream.CHUNK + 1,
                                  5 * gzip_stream.CHUNK + 12345])
def test_the_stream_decompresses_to_its_input_as_one_member(size):
    rng = random.Random(size)
    # half compressible text, half random bytes (the JPEG payloads), as shards are
    data = rng.randbytes(size // 2) + b"no acute cardiopulmonary process. " * (size // 68)
    data += b"x" * (size - len(data))
    blob = _compressed(data, [7, 1000, gzip_stream.CHUNK])
    assert gzip.decompress(blob) == data
    # one member: zlib's gzip decoder, which stops at the end of a member, reads it all and leaves nothing over
    one = zlib.decompressobj(wbits=31)
    assert one.decompress(blob) == data and one.eof and one.unused_data == b""


def test_the_same_input_gives_the_same_bytes_however_it_is_written():
    data = random.Random(0).randbytes(3 * gzip_stream.CHUNK) + b"json " * 40000
    ways = [[len(data)], [1] * 10 + [gzip_stream.CHUNK], [gzip_stream.CHUNK // 3] * 9, [10240] * 70]
    blobs = {_compressed(data, pieces) for pieces in ways}
    assert len(blobs) == 1
    assert len(blobs.pop()) < len(data)  # the text part shrinks


def test_a_tar_written_through_it_reads_back_in_tarfiles_stream_mode():
    """webdataset reads shards with tarfile's "r|*", which stops after a first gzip member: the whole tar must come
    back through it."""
    members = {f"{i:04d}.jpg": random.Random(i).randbytes(70_000) for i in range(12)}
    out = io.BytesIO()
    stream = ParallelGzipWriter(out, 1)
    with tarfile.open(fileobj=stream, mode="w|") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    stream.close()
    with tarfile.open(fileobj=io.BytesIO(out.getvalue()), mode="r|*") as tar:
        read = {m.name: tar.extractfile(m).read() for m in tar}
    assert read == members


def test_writing_after_close_is_refused_and_the_streams_threads_are_gone():
    stream = ParallelGzipWriter(io.BytesIO(), 1)
    stream.write(random.Random(1).randbytes(3 * gzip_stream.CHUNK))
    assert any(t.name.startswith("gzip") for t in threading.enumerate())
    stream.close()
    assert not any(t.name.startswith("gzip") for t in threading.enumerate())  # nothing left to a later fork
    with pytest.raises(ValueError, match="closed gzip stream"):
        stream.write(b"late")
