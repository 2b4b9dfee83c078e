"""``nih-bbox:PATH/nih_bbox.jsonl``: the NIH ChestX-ray14 box subset (BBox_List_2017) as shared/data holds it.

One row per image: ``image`` (relative to the file's folder unless ``image_root``), ``id``, ``subject_id``,
``study_id``, ``split`` (patient-disjoint, taken from the file), ``view``, ``labels`` (the 14-label list, exhaustive:
a label not listed is absent; ``[]`` is No Finding) and ``boxes`` ({label, box} in stored pixels).
There is no report: each record's text is composed from its labels (``captions.from_labels``): the positives,
then the box findings it does not have as stated negatives, marked ``text_source: labels``.
Labels become CheXpert-14 values (``cxrdr.common.nih.chexpert_labels``); the NIH list is kept in
``extra.nih_labels``; box labels are canonical (``Infiltrate``), boxes kept for evaluation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from cxrdr.common.nih import BOX_FINDINGS, canonical_finding, chexpert_labels, finding_words
from cxrdr.reinforce.captions.from_labels import TEXT_SOURCE_LABELS, compose_report, label_triples
from cxrdr.reinforce.records import Record
from cxrdr.reinforce.sources.common import (BaseSource, Skip, normalize_split, read_jsonl, require_file,
                                            resolve_image, text)


class NihBboxSource(BaseSource):
    name = "nih-bbox"

    def __init__(self, spec: str, path: str | Path, image_root: str | Path | None = None,
                 min_report_chars: int = 30, frontal_only: bool = False):
        super().__init__(spec, min_report_chars)
        self.path = require_file(path, "nih-bbox jsonl")
        self.image_root = Path(image_root).expanduser() if image_root else self.path.parent
        if not self.image_root.is_dir():
            raise ValueError(f"image root not found: {self.image_root}")
        self.frontal_only = bool(frontal_only)

    def _options(self) -> dict:
        return {"path": str(self.path), "image_root": str(self.image_root), "frontal_only": self.frontal_only}

    def _extra_description(self) -> dict:
        return {"license": "CC0-1.0", "text": "composed from labels (text_source: labels); no report text"}

    def _record(self, lineno: int, row: dict) -> Record | Skip:
        rid = text(row.get("id")) or f"line {lineno}"
        split = normalize_split(row.get("split"))
        if split is None:
            return Skip(rid, f"bad split: {row.get('split')!r} at {self.path.name}:{lineno}")
        labels = row.get("labels") or []
        boxes = row.get("boxes") or []
        if not isinstance(labels, list) or not isinstance(boxes, list):
            return Skip(rid, f"bad row: {self.path.name}:{lineno}: labels and boxes must be lists")
        try:
            boxes = [{"label": canonical_finding(b["label"]), "box": [float(x) for x in b["box"]]} for b in boxes]
        except (KeyError, TypeError, ValueError) as exc:
            return Skip(rid, f"bad row: {self.path.name}:{lineno}: bad box ({exc})")
        if any(len(b["box"]) != 4 for b in boxes):
            return Skip(rid, f"bad row: {self.path.name}:{lineno}: a box is not [x0, y0, x1, y1]")
        present = [canonical_finding(n) for n in labels if canonical_finding(n) != "No Finding"]
        positives = [finding_words(n) for n in present]
        negatives = [finding_words(n) for n in BOX_FINDINGS if n not in present]
        subject = text(row.get("subject_id")) or rid
        return Record(id=rid, subject_id=subject, study_id=text(row.get("study_id")) or rid, split=split,
                      report=compose_report(positives, negatives, normal=not present),
                      image=resolve_image(row.get("image"), self.image_root), view=text(row.get("view")) or None,
                      labels=chexpert_labels(present), triples=label_triples(positives), boxes=boxes,
                      extra={"text_source": TEXT_SOURCE_LABELS, "nih_labels": "|".join(present),
                             "view_raw": text(row.get("view_raw")), "license": text(row.get("license"))})

    def _candidates(self) -> Iterator[Record | Skip]:
        return self._records_of_rows(read_jsonl(self.path), self._record, self.frontal_only)
