"""What every file-backed source shares: the validation pass, skip accounting and small helpers.

A subclass yields candidate ``Record``s (or ``Skip``s for rows it could not even parse) from
``_candidates()``; ``BaseSource.__iter__`` validates them at the text level (duplicate id,
empty/short report, missing image file, bad split) and counts what it yields. Every pass
re-reads the file and resets ``skipped``/``counts``, so a source is re-iterable, deterministic,
and its accounting always describes the last complete pass.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from cxrdr.common.views import is_frontal
from cxrdr.reinforce.captions.from_labels import (TEXT_SOURCE_LABELS, TEXT_SOURCE_REPORT, TEXT_SOURCE_RETRIEVED,
                                                  report_from_labels)
from cxrdr.reinforce.records import SPLITS, Record, SkipLog

_SPLIT_ALIASES = {"train": "train", "training": "train", "val": "val", "valid": "val", "validate": "val",
                  "validation": "val", "dev": "val", "test": "test", "testing": "test"}


@dataclass
class Skip:
    """A row a subclass could not turn into a record (reason 'category: detail')."""

    id: str
    reason: str


def normalize_split(value) -> str | None:
    """'validate' -> 'val' etc.; None for unknown values."""
    if value is None:
        return None
    return _SPLIT_ALIASES.get(str(value).strip().lower())


def hash_split(subject_id: str) -> str:
    """Patient-disjoint 80/10/10 split by subject, the rule the shared data used."""
    bucket = int(hashlib.sha1(f"split:{subject_id}".encode()).hexdigest(), 16) % 100
    return "train" if bucket < 80 else "val" if bucket < 90 else "test"


def join_report(findings: str, impression: str) -> str:
    return " ".join(part.strip() for part in (findings or "", impression or "") if part and part.strip())


def text(value) -> str:
    """A JSON/CSV cell as stripped text ('' for None/NaN)."""
    if value is None:
        return ""
    if isinstance(value, float) and value != value:
        return ""
    return str(value).strip()


def resolve_image(value, base: Path) -> str | None:
    """An image cell -> absolute path string (relative paths are under ``base``)."""
    value = text(value)
    if not value:
        return None
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base / path)


def bad_text_field(value, name: str = "") -> str | None:
    """Path of the first string in ``value`` (a row: dicts, lists, strings) that is not valid
    UTF-8 text: invalid bytes (read with errors='surrogateescape') or a lone surrogate such as a
    JSON ``\\ud800``. Such text cannot be written to a shard, so its row is skipped up front."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return name or "value"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((f"{name}[{i}]", v) for i, v in enumerate(value))
        return next((bad for key, v in items if (bad := bad_text_field(v, key))), None)
    else:
        return None
    for key, v in items:
        where = f"{name}.{key}" if name else str(key)
        bad = bad_text_field(key, where + " (key)") if isinstance(key, str) else None
        if bad or (bad := bad_text_field(v, where)):
            return bad.encode("utf-8", "backslashreplace").decode("utf-8")
    return None


def bad_text_skip(row: dict, path: Path, lineno: int) -> Skip | None:
    field = bad_text_field(row)
    if field is None:
        return None
    return Skip(f"line {lineno}", f"bad text: {path.name}:{lineno}: field {field!r} is not valid UTF-8 "
                                  f"(invalid bytes or a lone surrogate)")


def read_jsonl(path: Path) -> Iterator[tuple[int, dict | Skip]]:
    """(line number, row dict) per non-empty line; a bad line becomes a Skip with id 'line N'."""
    # surrogateescape: a line with invalid UTF-8 bytes still reads; bad_text_skip then skips it.
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, Skip(f"line {lineno}", f"bad json: {path.name}:{lineno}: {exc.msg}")
                continue
            if not isinstance(row, dict):
                yield lineno, Skip(f"line {lineno}", f"bad json: {path.name}:{lineno}: not an object")
                continue
            yield lineno, bad_text_skip(row, path, lineno) or row


def require_file(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{what} not found: {path}")
    return path


def label_text(rec: Record) -> None:
    """A record with labels but no report text gets a report composed from its labels (marked
    ``text_source: labels`` so it is never taken for a radiologist's report); a source that composed its
    own (NIH: its vocabulary, stated negatives) has marked it already. Without labels it stays empty and
    is skipped as an empty report."""
    if (rec.report or "").strip() or not rec.labels:
        return
    composed = report_from_labels(rec.labels)
    if composed is None:
        return
    rec.report, triples = composed
    rec.triples = rec.triples or triples
    rec.extra["text_source"] = TEXT_SOURCE_LABELS


class BaseSource:
    """Validation and accounting around a subclass's ``_candidates()`` generator."""

    name = "source"
    requires_images = True
    # A build with a captioner sets this: an image without report text (nor labels to compose one from) is
    # then kept, marked text_source: retrieved (the captioner gives it its text); otherwise "empty report".
    allow_image_only = False

    def __init__(self, spec: str, min_report_chars: int = 30):
        self.spec = spec
        self.min_report_chars = int(min_report_chars)
        self.skipped = SkipLog()
        self.counts: dict = {}
        self.filtered: Counter = Counter()  # rows left out by design (e.g. lateral views), by reason
        self._passes = 0

    # subclasses -----------------------------------------------------------------------------
    def _candidates(self) -> Iterator[Record | Skip]:
        raise NotImplementedError

    def _options(self) -> dict:
        return {}

    def _records_of_rows(self, rows, record, frontal_only: bool) -> Iterator[Record | Skip]:
        """``record(lineno, row)`` of each ``(lineno, row)`` (a row already a Skip passes through); with
        ``frontal_only`` a non-frontal record is counted in ``filtered`` instead of yielded."""
        for lineno, row in rows:
            if isinstance(row, Skip):
                yield row
                continue
            rec = record(lineno, row)
            if isinstance(rec, Record) and frontal_only and not is_frontal(rec.view):
                self.filtered[f"not frontal: {rec.view}"] += 1
                continue
            yield rec

    def _extra_description(self) -> dict:
        return {}

    # protocol -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Record]:
        self.skipped.entries.clear()
        self.filtered.clear()
        seen: set[str] = set()
        by_split: Counter = Counter()
        text_sources: Counter = Counter()
        rows = 0
        for item in self._candidates():
            rows += 1
            if isinstance(item, Skip):
                self.skipped.skip(item.id, item.reason)
                continue
            label_text(item)
            if self.allow_image_only and self.requires_images and not (item.report or "").strip() \
                    and item.image is not None:
                item.extra["text_source"] = TEXT_SOURCE_RETRIEVED
            reason = self._problem(item, seen)
            if reason:
                self.skipped.skip(item.id, reason)
                continue
            seen.add(item.id)
            by_split[item.split] += 1
            text_sources[item.extra.get("text_source", TEXT_SOURCE_REPORT)] += 1
            yield item
        self.counts = {"rows": rows, "records": sum(by_split.values()),
                       "by_split": {s: by_split[s] for s in SPLITS if by_split[s]},
                       "filtered": dict(self.filtered), "text_source": dict(text_sources)}
        self._passes += 1

    def _problem(self, rec: Record, seen: set[str]) -> str | None:
        if not rec.id:
            return "missing id: empty id"
        texts = {"id": rec.id, "subject_id": rec.subject_id, "study_id": rec.study_id, "report": rec.report,
                 "findings": rec.findings, "impression": rec.impression, "view": rec.view,
                 "triples": rec.triples, "labels": rec.labels}
        field = bad_text_field(texts)
        if field:
            return f"bad text: field {field!r} is not valid UTF-8 (invalid bytes or a lone surrogate)"
        if rec.id in seen:
            return f"duplicate id: {rec.id}"
        if rec.split not in SPLITS:
            return f"bad split: {rec.split!r}"
        report = (rec.report or "").strip()
        image_only = rec.extra.get("text_source") == TEXT_SOURCE_RETRIEVED and not report
        if not report and not image_only:
            return "empty report: no findings/impression text"
        if not image_only and rec.extra.get("text_source") != TEXT_SOURCE_LABELS and len(report) < self.min_report_chars:
            return f"short report: {len(report)} chars < {self.min_report_chars}"
        if self.requires_images:
            if rec.image is None:
                return "missing image: no image given"
            if isinstance(rec.image, (str, Path)) and not Path(rec.image).is_file():
                return f"missing image: {rec.image}"
        return None

    def describe(self) -> dict:
        """JSON-able description (for dataset.json); runs one pass first if none was made."""
        if not self._passes:
            for _ in self:
                pass
        skipped = self.skipped.to_json()
        skipped["records"] = skipped["records"][:50]  # keep dataset.json small; the build logs all
        return {"name": self.name, "spec": self.spec, "requires_images": self.requires_images,
                "min_report_chars": self.min_report_chars, "options": self._options(),
                "counts": self.counts, "skipped": skipped, **self._extra_description()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
