"""The one record type every source yields, and the accounting of records a source skips.

A record is one image (or, for text-only sources, one report) with its report, labels,
RDF-style triples and optional boxes. Sources never raise on bad input: they call
``SkipLog.skip(id, reason)`` and move on, so a build can say exactly what it left out.
"""
from __future__ import annotations

import io
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Union

from PIL import Image

from cxrdr.common.labels import CHEXPERT14

log = logging.getLogger(__name__)

SPLITS: tuple[str, ...] = ("train", "val", "test")

# A record's image: a file path, encoded bytes, or a picklable zero-argument callable
# (e.g. functools.partial of a module-level renderer) so DataLoader workers can render it.
ImageRef = Union[str, Path, bytes, Callable[[], Image.Image], None]

Triple = tuple[str, str, str]


@dataclass
class Record:
    id: str
    subject_id: str
    study_id: str
    split: str
    report: str
    image: ImageRef = None
    view: str | None = None
    findings: str = ""
    impression: str = ""
    # CheXpert-14 name -> 1 (positive), 0 (negative), -1 (uncertain), None (not mentioned).
    labels: dict[str, int | None] = field(default_factory=dict)
    triples: list[Triple] = field(default_factory=list)
    # Boxes in pixel coordinates of the record's image: {"label": str, "box": [x0, y0, x1, y1]}.
    boxes: list[dict] = field(default_factory=list)
    # Anything source-specific worth carrying into shard metadata (licence, MeSH codes, ...).
    extra: dict = field(default_factory=dict)

    def label_vector(self, uncertain_as: float = 1.0) -> list[float]:
        """CheXpert-14 as floats: positive 1, negative/missing 0, uncertain -> ``uncertain_as``."""
        out = []
        for name in CHEXPERT14:
            value = self.labels.get(name)
            out.append(uncertain_as if value == -1 else float(value == 1))
        return out


# A JPEG source is decoded at the coarsest DCT scale (1/2, 1/4 or 1/8; PIL's ``draft``) that keeps it at least
# this many times the size it is stored at, as PIL's own ``Image.thumbnail`` does (its ``reducing_gap``). A
# MIMIC-CXR JPEG (~2,500 x 3,000) stored at 256 then decodes at 1/4 scale: ~4x less of a build worker's CPU, and
# the stored pixels move by less than the stored JPEG's own quantisation (``benchmarks/source_decode.py``).
JPEG_DRAFT_GAP = 2.0


def load_image(record: Record) -> Image.Image:
    """Decode a record's image as 8-bit grayscale. Raises on a missing or unreadable image."""
    return _to_gray(_loaded(_open(record)))


def load_image_for_store(record: Record, short_side: int) -> tuple[Image.Image, tuple[int, int]]:
    """(8-bit grayscale image, the source's own (width, height)) for storing at ``short_side``: a JPEG is
    decoded at a reduced scale when it is more than ``JPEG_DRAFT_GAP`` times larger (the image is then
    smaller than the source, so the boxes, in the source's pixels, scale from the size returned)."""
    image = _open(record)
    source_size = image.size
    if getattr(image, "format", None) == "JPEG":
        scale = JPEG_DRAFT_GAP * short_side / min(source_size)
        if scale < 1:  # draft keeps both sides >= the requested ones
            image.draft("L", (int(source_size[0] * scale + 0.999), int(source_size[1] * scale + 0.999)))
    return _to_gray(_loaded(image)), source_size


def _open(record: Record) -> Image.Image:
    ref = record.image
    if ref is None:
        raise ValueError(f"record {record.id!r} has no image")
    if callable(ref):
        return ref()
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref))
    path = Path(ref)
    if not path.is_file():
        raise FileNotFoundError(f"record {record.id!r}: image file not found: {path}")
    return Image.open(path)


def _loaded(image: Image.Image) -> Image.Image:
    image.load()  # force decoding now so truncated files fail here, not later
    return image


def _to_gray(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I", "F"):
        # 16-bit/float sources: min-max to 8 bit, as the shared data's preparation did.
        import numpy as np

        arr = np.asarray(image, dtype=np.float32)
        lo, hi = float(arr.min()), float(arr.max())
        arr = (arr - lo) / max(hi - lo, 1e-6) * 255.0
        image = Image.fromarray(arr.astype("uint8"))
    if image.mode in ("RGBA", "LA"):
        background = Image.new("RGBA", image.size, (0, 0, 0, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("L")


@dataclass
class SkipLog:
    """Records a source or a build left out, by id and reason. Nothing is dropped silently."""

    entries: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, record_id: str, reason: str) -> None:
        # An id may itself be broken text (lone surrogates): keep it printable and writable.
        record_id = str(record_id).encode("utf-8", "backslashreplace").decode("utf-8")
        self.entries.append((record_id, reason))
        log.warning("skipped %s: %s", record_id, reason)

    def extend(self, other: "SkipLog") -> None:
        self.entries.extend(other.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def by_reason(self) -> dict[str, int]:
        """Counts per reason category (the text before the first ':')."""
        return dict(Counter(reason.split(":", 1)[0] for _, reason in self.entries))

    def summary(self, limit: int = 20) -> str:
        if not self.entries:
            return "skipped 0 records"
        lines = [f"skipped {len(self.entries)} records ({self.by_reason()}):"]
        lines += [f"  {rid}: {reason}" for rid, reason in self.entries[:limit]]
        if len(self.entries) > limit:
            lines.append(f"  ... and {len(self.entries) - limit} more")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"count": len(self.entries), "by_reason": self.by_reason(),
                "records": [{"id": rid, "reason": reason} for rid, reason in self.entries]}


def iter_splits(records: list[Record]) -> Iterator[tuple[str, list[Record]]]:
    """Records grouped by split in the canonical order train, val, test (others last)."""
    order = {name: i for i, name in enumerate(SPLITS)}
    groups: dict[str, list[Record]] = {}
    for rec in records:
        groups.setdefault(rec.split, []).append(rec)
    for name in sorted(groups, key=lambda s: (order.get(s, len(order)), s)):
        yield name, groups[name]
