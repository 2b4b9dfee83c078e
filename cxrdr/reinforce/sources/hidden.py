"""Source options ``hide_reports`` + ``hidden``: a fraction of the **train** studies lose their report.

Which studies: those whose ``sha1("hide:<study_id>")`` falls below the fraction (deterministic, the same
studies in every build of the same records whatever the other options); val and test studies keep theirs.
What becomes of a hidden study (``hidden``):

| hidden | its records |
|---|---|
| ``image-only`` (default) | kept without report, findings, impression, labels or triples (``text_source: retrieved``: a build with ``--captioner`` gives them their text; a build without one leaves them out) |
| ``labels`` | kept; the report is composed from the labels (``text_source: labels``, as for a source without reports) |
| ``drop`` | left out (the paired part only) |

So one recipe builds the "only some studies have reports" world three ways from the same source (the
image-only experiment, configs/experiments/image-only.yaml), and ``retrieval:train`` then banks exactly
the reports still visible.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from typing import Iterator

from cxrdr.reinforce.captions.from_labels import TEXT_SOURCE_RETRIEVED
from cxrdr.reinforce.records import Record
from cxrdr.reinforce.sources.common import label_text

HIDDEN_MODES = ("image-only", "labels", "drop")


def hidden_study(study_id: str, fraction: float) -> bool:
    """Whether the study's report is hidden at this fraction (stable in the study id alone)."""
    bucket = int(hashlib.sha1(f"hide:{study_id}".encode()).hexdigest()[:12], 16) / float(16 ** 12)
    return bucket < fraction


def check_hidden(fraction, mode) -> tuple[float, str]:
    try:
        fraction = float(fraction)
    except (TypeError, ValueError):
        raise ValueError(f"hide_reports must be a fraction in [0, 1], got {fraction!r}") from None
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"hide_reports must be a fraction in [0, 1], got {fraction}")
    mode = mode or HIDDEN_MODES[0]
    if mode not in HIDDEN_MODES:
        raise ValueError(f"hidden must be one of {', '.join(HIDDEN_MODES)}, got {mode!r}")
    return fraction, mode


class HiddenReports:
    """A source whose train studies' reports are hidden (see the module docstring)."""

    def __init__(self, inner, fraction: float, mode: str | None = None):
        self.inner = inner
        self.fraction, self.mode = check_hidden(fraction, mode)
        self.name = inner.name
        self.requires_images = getattr(inner, "requires_images", True)
        self.counts: dict = {}
        self.allow_image_only = False  # a build with --captioner sets it: image-only records are kept

    @property
    def skipped(self):
        return self.inner.skipped

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Record]:
        counts: Counter = Counter()
        for rec in self.inner:
            if rec.split != "train" or not hidden_study(str(rec.study_id), self.fraction):
                counts["paired_records"] += 1
                yield rec
                continue
            counts["hidden_records"] += 1
            if self.mode == "drop":
                continue
            if self.mode == "labels":
                rec = dataclasses.replace(rec, report="", findings="", impression="", triples=[],
                                          extra=dict(rec.extra or {}))
                label_text(rec)
            else:
                rec = dataclasses.replace(rec, report="", findings="", impression="", labels={}, triples=[],
                                          extra={**(rec.extra or {}), "text_source": TEXT_SOURCE_RETRIEVED})
            if (rec.report or "").strip() or (self.mode == "image-only" and self.allow_image_only):
                yield rec
            else:
                counts["hidden_left_out"] += 1
        self.counts = dict(counts)

    def describe(self) -> dict:
        return {**self.inner.describe(),
                "hide_reports": {"fraction": self.fraction, "hidden": self.mode, "splits": ["train"],
                                 "rule": "sha1('hide:' + study_id) < fraction", **self.counts}}


__all__ = ["HIDDEN_MODES", "HiddenReports", "check_hidden", "hidden_study"]
