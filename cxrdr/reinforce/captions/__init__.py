"""Synthetic captions per study: RDF-triple templates and report-sentence sampling.

``make_captions(record, n=5, seed=0, sources=("rdf", "report"))`` returns exactly ``n``
``Caption``s, deterministic in (seed, record.id):

- ``rdf``: template captions from the record's triples (``cxrdr.reinforce.captions.rdf``); a record with
  no finding triples that is known normal (``is_normal``) gets normal-study captions instead
  (source "normal"). Records that are neither (e.g. disease labels without triples) get none.
- ``report``: the impression, the findings, single sentences and random sentence subsets
  (``cxrdr.reinforce.captions.report``).
The sources take turns (rdf first) so both are represented; each source's candidates are
distinct and already in a diverse order. When the pool of distinct texts has at least ``n``
texts the result has no duplicates; when it has fewer, the result cycles through the pool in
order, so ``len(set(texts)) == min(n, pool size)``. A record with neither triples nor report text
gets the report itself (or "Chest radiograph.") as its only pool entry. Text-only records work:
the image is never touched.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass

from cxrdr.reinforce.records import Record
from cxrdr.reinforce.captions.rdf import normal_captions, rdf_captions
from cxrdr.reinforce.captions.report import report_captions

CAPTION_SOURCES = ("rdf", "report")
FALLBACK_CAPTION = "Chest radiograph."


@dataclass(frozen=True)
class Caption:
    text: str
    source: str  # "rdf", "report" or "normal"

    def to_json(self) -> dict:
        return asdict(self)


def _rng(seed: int, record_id: str, part: str) -> random.Random:
    digest = hashlib.sha256(f"captions|{seed}|{record_id}|{part}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def is_normal(record: Record) -> bool:
    """No finding triples, and labels say normal (No Finding = 1, or every label given is 0)."""
    if record.triples:
        return False
    labels = record.labels or {}
    if labels.get("No Finding") == 1:
        return True
    return bool(labels) and all(v in (0, None) for v in labels.values()) and \
        any(v == 0 for v in labels.values())


def caption_pool(record: Record, seed: int = 0, sources=CAPTION_SOURCES) -> list[Caption]:
    """All distinct candidate captions, in the order ``make_captions`` uses them."""
    unknown = set(sources) - set(CAPTION_SOURCES)
    if unknown:
        raise ValueError(f"unknown caption source(s) {', '.join(sorted(unknown))}; "
                         f"valid: {', '.join(CAPTION_SOURCES)}")
    streams: list[list[Caption]] = []
    for source in sources:
        rng = _rng(seed, record.id, source)
        if source == "rdf":
            if record.triples:
                streams.append([Caption(t, "rdf") for t in rdf_captions(record.triples, rng)])
            elif is_normal(record):
                streams.append([Caption(t, "normal") for t in normal_captions(rng)])
        else:
            texts = report_captions(record.findings, record.impression, record.report, rng)
            streams.append([Caption(t, "report") for t in texts])
    pool, seen = [], set()
    longest = max((len(s) for s in streams), default=0)
    for i in range(longest):
        for stream in streams:
            if i < len(stream) and stream[i].text not in seen:
                seen.add(stream[i].text)
                pool.append(stream[i])
    if not pool:
        text = (record.report or "").strip() or FALLBACK_CAPTION
        pool = [Caption(text, "report")]
    return pool


def make_captions(record: Record, n: int = 5, seed: int = 0, sources=CAPTION_SOURCES) -> list[Caption]:
    """Exactly ``n`` captions for a record (see the module docstring for the rules)."""
    if n < 1:
        raise ValueError(f"number of captions must be >= 1, got {n}")
    pool = caption_pool(record, seed, sources)
    return [pool[i % len(pool)] for i in range(n)]


__all__ = ["Caption", "make_captions", "caption_pool", "is_normal", "CAPTION_SOURCES"]
