"""The benchmark's images: rows of a ``nih_bbox.jsonl`` (shared/data layout), read in place from their PNGs."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from cxrdr.common.nih import canonical_finding


@dataclass
class BoxImage:
    """One benchmark image: its findings (canonical names, Infiltration = Infiltrate) and boxes in stored pixels."""

    key: str
    path: Path
    split: str
    findings: set[str]
    boxes: list[dict] = field(default_factory=list)  # {"label": canonical finding, "box": [x0, y0, x1, y1]}

    def image(self) -> Image.Image:
        try:
            with Image.open(self.path) as im:
                return im.convert("L")
        except OSError as exc:
            raise ValueError(f"benchmark image {self.key}: cannot read {self.path}: {exc}") from None

    def size(self) -> tuple[int, int]:
        """(width, height) from the file's header, without decoding the pixels."""
        try:
            with Image.open(self.path) as im:
                return im.size
        except OSError as exc:
            raise ValueError(f"benchmark image {self.key}: cannot read {self.path}: {exc}") from None

    def boxes_of(self, finding: str | None = None) -> list[list[float]]:
        return [b["box"] for b in self.boxes if finding is None or b["label"] == finding]


def load_rows(path: str | Path, split: str | None = None) -> list[BoxImage]:
    """Rows of the jsonl (one split, or all), in file order; a bad line or missing image is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"benchmark file not found: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key, image = str(row["id"]), path.parent / row["image"]
            boxes = [{"label": canonical_finding(b["label"]), "box": [float(x) for x in b["box"]]}
                     for b in row.get("boxes") or []]
            findings = {canonical_finding(n) for n in row.get("labels") or []}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: bad benchmark row ({type(exc).__name__}: {exc})") from None
        if split is not None and row.get("split") != split:
            continue
        if not image.is_file():
            raise ValueError(f"{path}:{lineno}: image of {key} not found: {image}")
        # a boxed finding is a finding of the image even where the label list missed it
        rows.append(BoxImage(key, image, str(row.get("split")), findings | {b["label"] for b in boxes}, boxes))
    return rows
