"""Reading shards: the strict tar reader and the one sample decoder every reader uses."""
from __future__ import annotations

import io
import tarfile
import tempfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from cxrdr.common.shards.embeddings import sample_embeddings
from cxrdr.common.shards.members import IMAGE_EXTS
from cxrdr.common.shards.meta import load_meta


GZIP_MAGIC = b"\x1f\x8b"
SPOOL_BYTES = 256 * 2**20  # a decompressed shard up to this size stays in memory, a larger one on disk


@contextmanager
def open_tar_stream(path):
    """``(file, damage)``: the shard's uncompressed tar bytes as a seekable file, whether it is a
    ``.tar`` or gzip, and the error that cut a damaged gzip stream short (None when intact).

    A gzip shard is decompressed once into a spooled temp file: the strict end-of-archive check
    seeks back, which a ``GzipFile`` can only do by decompressing again from the start. What a cut
    or corrupted stream gave up to the damage is kept, so the samples before it still read.
    """
    with open(path, "rb") as raw:
        if raw.read(2) != GZIP_MAGIC:
            raw.seek(0)
            yield raw, None
            return
        raw.seek(0)
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
            damage = _gunzip_into(raw, spool)
            spool.seek(0)
            yield spool, damage


def _gunzip_into(raw, out) -> tarfile.ReadError | None:
    """Decompress the gzip stream(s) of ``raw`` into ``out``; the damage, if any, as an error.

    zlib directly rather than ``gzip.GzipFile``: GzipFile discards the output of the read call that
    meets the damage, while a decompressobj hands out everything before it.
    """
    inflate = zlib.decompressobj(wbits=31)  # 31: gzip header and CRC-32 trailer, checked by zlib
    try:
        while chunk := raw.read(2**20):
            while chunk:
                out.write(inflate.decompress(chunk))
                chunk = inflate.unused_data if inflate.eof else b""
                if inflate.eof:  # a second gzip member follows (concatenated .gz files are valid)
                    inflate = zlib.decompressobj(wbits=31) if chunk else inflate
    except zlib.error as exc:
        return tarfile.ReadError(f"damaged gzip stream ({exc})")
    out.write(inflate.flush())
    if not inflate.eof:
        return tarfile.ReadError("damaged gzip stream (cut short: no end-of-stream marker)")
    return None


def iter_tar_samples(path):
    """Yield (key, {ext: bytes}) in tar order; raises tarfile.ReadError/EOFError on damage.

    Stricter than ``webdataset.tarfile_to_samples``, which stops silently at a tar cut between
    two members: a truncated or duplicated member is an error, and after the last sample the
    archive must end with its zero end-of-archive blocks. Reads ``.tar`` and gzip shards alike;
    in a damaged gzip shard the samples before the damage are yielded, then the damage is raised.
    """
    with open_tar_stream(path) as (raw, damage):
        try:
            yield from _samples_of_tar(raw)
        except (tarfile.TarError, EOFError) as exc:
            if damage is None:
                raise
            raise damage from exc
        if damage is not None:
            raise damage


def _samples_of_tar(raw):
    tf = tarfile.open(fileobj=raw, mode="r:")
    key, parts = None, {}
    for member in tf:
        if not member.isfile():
            continue
        data = tf.extractfile(member).read()
        if len(data) != member.size:
            raise tarfile.ReadError(f"member {member.name} is truncated")
        k, _, ext = member.name.rsplit("/", 1)[-1].partition(".")
        if k != key:
            if key is not None:
                yield key, parts
            key, parts = k, {}
        if ext in parts:
            raise tarfile.ReadError(f"member {member.name} appears twice")
        parts[ext] = data
    end = tf.offset
    if key is not None:
        yield key, parts
    raw.seek(end)
    tail = raw.read(1024)
    if len(tail) < 1024 or any(tail):
        raise tarfile.ReadError(f"truncated: no end-of-archive marker at byte {end}")


def iter_raw_samples(urls):
    """Raw samples ``{"__key__", "__url__", ext: bytes}`` of several tars, strictly, in order."""
    for url in urls:
        for key, parts in iter_tar_samples(Path(url)):
            yield {"__key__": key, "__url__": str(url), **parts}


@dataclass
class Sample:
    """One decoded sample: metadata and report now; image and embeddings when asked for."""

    key: str
    url: str | None
    meta: dict
    report: str
    image_bytes: bytes | None  # None in a text-only build
    members: dict  # the raw {ext: bytes}, for the embedding members

    @property
    def split(self) -> str | None:
        return self.meta.get("split")

    @property
    def labels(self) -> list[float]:
        """CheXpert-14 label vector (U-ones, as stored)."""
        return list(self.meta.get("label_vector") or [0.0] * 14)

    def image(self) -> Image.Image:
        """The stored image decoded with PIL as 8-bit grayscale (the pixels the build replayed)."""
        if self.image_bytes is None:
            raise ValueError(f"sample {self.key!r} in {self.url}: no image (.png/.jpg)")
        return Image.open(io.BytesIO(self.image_bytes)).convert("L")

    def embeddings(self, teacher: str) -> dict | None:
        """One teacher's float32 parts {'img'?, 'syn', 'txt'} (None when the sample has none)."""
        return sample_embeddings(self.members, teacher, len(self.meta.get("aug") or []),
                                 len(self.meta.get("captions") or []))


def decode_sample(raw: dict) -> Sample:
    """Raw sample -> :class:`Sample` (its meta in the meaning of :func:`decode_meta`, whatever the
    schema). ValueError (naming key and shard) when the json or the report member is missing or does
    not decode.

    Only json and txt are decoded here; the image and the embeddings only on request, as a
    reader usually needs one view and a few rows (``webdataset.decode`` would decode every member).
    """
    key, url = raw.get("__key__"), raw.get("__url__")
    where = f"sample {key!r} in {url}"
    try:
        meta = load_meta(raw["json"])
        report = raw["txt"].decode("utf-8")
    except KeyError as exc:
        raise ValueError(f"{where}: no .{exc.args[0]} member") from None
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{where}: json or txt does not decode ({exc})") from None
    image = next((raw[e] for e in IMAGE_EXTS if e in raw), None)
    return Sample(str(key if key is not None else meta.get("key")), url, meta, report, image, raw)
