"""Generic ``jsonl:PATH`` / ``csv:PATH`` sources: one row per image, columns mapped by flags only.

Column flags (defaults are the ``Record`` field names, so a phantom ``records.jsonl`` reads back
with no flags): ``col_id`` (id), ``col_image`` (image), ``col_report`` (report), ``col_findings``
(findings), ``col_impression`` (impression), ``col_labels`` (labels), ``col_split`` (split),
``col_subject`` (subject_id), ``col_study`` (study_id), ``col_view`` (view), ``col_triples``
(triples), ``col_boxes`` (boxes).

- id: when the id column is absent, the image file's stem is the id (else ``line N``).
- report: the report column; when empty, findings + impression joined.
- image: a path relative to ``image_root`` if given, else to the file's folder; absolute paths
  are kept. Missing files are skipped ("missing image: PATH").
- split: 'train'/'val'/'test' (aliases like 'validate' accepted); when the column is absent the
  split is a patient-disjoint 80/10/10 hash of the subject id (the shared data's rule).
- subject/study: default to the id when absent.
- labels (``labels_format``): 'auto' (default: dict as is, list -> names with value 1),
  'list' (names of positives; CSV cells split on '|', ';' or ','), 'dict' (name -> value; a CSV
  cell holds JSON), 'columns' (one column per label: ``col_labels`` is a comma-separated list of
  column names, default the CheXpert-14 names present in the file). Values '1','0','-1','1.0'
  and '' map to 1/0/-1/None. Label names are kept as given: names that are not CheXpert-14 (the
  covid_cxr set's 'COVID-19', 'ARDS', ...) stay in ``labels`` with value 1 and simply do not enter
  the CheXpert label vector.
- triples: a list of [s, p, o] (JSON in CSV cells); boxes: a list of {"label", "box"} (JSON in CSV).
- ``frontal_only``: keep only PA/AP/frontal views (default: keep all; rows left out are counted).
Everything else in a row is kept in ``Record.extra`` (scalar values only).

Example, the shared COVID-19 set: ``jsonl:../shared/data/covid_cxr/covid_cxr.jsonl`` with no flags
(its rows have image/report/findings/impression/labels/split/subject_id/study_id/view); add
``col_boxes=lung_boxes`` to carry its lung boxes.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Iterator

from cxrdr.common.labels import CHEXPERT14
from cxrdr.reinforce.records import Record
from cxrdr.reinforce.sources.common import (BaseSource, Skip, bad_text_skip, hash_split, join_report, normalize_split,
                                      read_jsonl, require_file, resolve_image, text)

LABEL_FORMATS = ("auto", "list", "dict", "columns")
COLUMN_DEFAULTS = {"col_id": "id", "col_image": "image", "col_report": "report", "col_findings": "findings",
                   "col_impression": "impression", "col_labels": "labels", "col_split": "split",
                   "col_subject": "subject_id", "col_study": "study_id", "col_view": "view",
                   "col_triples": "triples", "col_boxes": "boxes"}


def label_value(value) -> int | None:
    """'1'/'1.0'/1/True -> 1, '0' -> 0, '-1' -> -1, ''/None/NaN -> None."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    s = text(value)
    if not s:
        return None
    try:
        number = float(s)
    except ValueError:
        raise ValueError(f"bad label value {value!r}") from None
    if number != number:
        return None
    return int(max(-1.0, min(1.0, round(number))))


def _maybe_json(value):
    if isinstance(value, str) and value.strip()[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            # CSVs written from pandas often hold Python reprs; accept those too.
            import ast

            return ast.literal_eval(value)
    return value


class TabularSource(BaseSource):
    """Rows of a JSONL or CSV file -> Records, by column flags only."""

    def __init__(self, spec: str, path: str | Path, fmt: str, image_root: str | Path | None = None,
                 min_report_chars: int = 30, labels_format: str = "auto", frontal_only: bool = False,
                 **columns: str | None):
        super().__init__(spec, min_report_chars)
        self.path = require_file(path, f"{fmt} file")
        self.fmt = fmt
        self.name = fmt
        self.image_root = Path(image_root).expanduser() if image_root else None
        if self.image_root is not None and not self.image_root.is_dir():
            raise ValueError(f"image root not found: {self.image_root}")
        if labels_format not in LABEL_FORMATS:
            raise ValueError(f"labels_format must be one of {', '.join(LABEL_FORMATS)}, got {labels_format!r}")
        self.labels_format = labels_format
        self.frontal_only = bool(frontal_only)
        unknown = set(columns) - set(COLUMN_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown column flag(s) {', '.join(sorted(unknown))}; "
                             f"valid: {', '.join(COLUMN_DEFAULTS)}")
        self.cols = {k: (columns.get(k) or v) for k, v in COLUMN_DEFAULTS.items()}

    def _options(self) -> dict:
        return {"path": str(self.path), "image_root": str(self.image_root) if self.image_root else None,
                "labels_format": self.labels_format, "frontal_only": self.frontal_only, "columns": self.cols}

    def _rows(self) -> Iterator[tuple[int, dict | Skip]]:
        if self.fmt == "jsonl":
            yield from read_jsonl(self.path)
            return
        # surrogateescape: a row with invalid UTF-8 bytes still reads; bad_text_skip then skips it.
        with open(self.path, newline="", encoding="utf-8", errors="surrogateescape") as fh:
            for lineno, row in enumerate(csv.DictReader(fh), 2):  # line 1 is the header
                if None in row:  # more cells than header columns
                    yield lineno, Skip(f"line {lineno}", f"bad row: {self.path.name}:{lineno}: extra cells")
                    continue
                yield lineno, bad_text_skip(row, self.path, lineno) or row

    def _labels(self, row: dict) -> dict[str, int | None]:
        fmt, col = self.labels_format, self.cols["col_labels"]
        if fmt == "columns":
            names = [c.strip() for c in col.split(",")] if col != "labels" else \
                [n for n in CHEXPERT14 if n in row]
            return {name: label_value(row.get(name)) for name in names if name in row}
        value = _maybe_json(row.get(col))
        if value is None or value == "":
            return {}
        if isinstance(value, dict) and fmt in ("auto", "dict"):
            return {str(k): label_value(v) for k, v in value.items()}
        if isinstance(value, str) and fmt in ("auto", "list"):
            sep = next((s for s in "|;," if s in value), None)
            value = value.split(sep) if sep else [value]
        if isinstance(value, (list, tuple)) and fmt in ("auto", "list"):
            return {str(name).strip(): 1 for name in value if str(name).strip()}
        raise ValueError(f"labels column {col!r} holds {type(value).__name__}, not labels_format {fmt!r}")

    def _record(self, lineno: int, row: dict) -> Record | Skip:
        c = self.cols
        base = self.image_root or self.path.parent
        image = resolve_image(row.get(c["col_image"]), base)
        rid = text(row.get(c["col_id"])) or (Path(image).stem if image else f"line {lineno}")
        findings, impression = text(row.get(c["col_findings"])), text(row.get(c["col_impression"]))
        report = text(row.get(c["col_report"])) or join_report(findings, impression)
        subject = text(row.get(c["col_subject"])) or rid
        study = text(row.get(c["col_study"])) or rid
        raw_split = row.get(c["col_split"])
        split = normalize_split(raw_split) if text(raw_split) else hash_split(subject)
        if split is None:
            return Skip(rid, f"bad split: {raw_split!r} at line {lineno}")
        view = text(row.get(c["col_view"])) or None
        try:
            labels = self._labels(row)
            triples = [tuple(str(x) for x in t) for t in (_maybe_json(row.get(c["col_triples"])) or [])]
            if any(len(t) != 3 for t in triples):
                raise ValueError("a triple is not [subject, predicate, object]")
            boxes = _maybe_json(row.get(c["col_boxes"])) or []
            if not isinstance(boxes, list):
                raise ValueError("boxes is not a list")
        except (ValueError, SyntaxError, TypeError) as exc:
            return Skip(rid, f"bad row: line {lineno}: {exc}")
        used = set(c.values())
        extra = {k: v for k, v in row.items()
                 if k not in used and (v is None or isinstance(v, (str, int, float, bool)))}
        return Record(id=rid, subject_id=subject, study_id=study, split=split, report=report, image=image,
                      view=view, findings=findings, impression=impression, labels=labels,
                      triples=triples, boxes=boxes, extra=extra)

    def _candidates(self) -> Iterator[Record | Skip]:
        return self._records_of_rows(self._rows(), self._record, self.frontal_only)
