"""Dataset sources: every one yields ``cxrdr.reinforce.records.Record``s (see DESIGN "Sources").

``open_source(spec, **options)`` turns a spec string into a ``Source``:

| spec | what |
|---|---|
| ``phantom[:N]`` | embedded generator (``cxrdr.reinforce.phantom.PhantomSource``), N studies (default 200) |
| ``mimic:PATH.jsonl`` | Patch-IB-CXR MIMIC-CXR master JSONL (``cxrdr.reinforce.sources.mimic``) |
| ``iu-xray:DIR`` | Open-i IU X-ray reports + MeSH (``cxrdr.reinforce.sources.iu_xray``) |
| ``nih-bbox:PATH.jsonl`` | NIH ChestX-ray14 box subset, text composed from labels (``cxrdr.reinforce.sources.nih_bbox``) |
| ``jsonl:PATH`` / ``csv:PATH`` | generic rows, columns mapped by flags (``cxrdr.reinforce.sources.tabular``) |

Options (CLI flags map 1:1; ``None`` means "not given"): image_root, seed (phantom: one or a list), size
and split (phantom: every study in that split),
min_report_chars (30), frontal_only, scene_graphs and label_order (mimic), col_id, col_image,
col_report, col_findings, col_impression, col_labels, col_split, col_subject, col_study, col_view,
col_triples, col_boxes, labels_format (jsonl/csv); hide_reports (a fraction of the train studies lose their
report) and hidden (image-only | labels | drop: what becomes of them), any source
(``cxrdr.reinforce.sources.hidden``). An option a source does not use is ignored
(logged when it was given a non-default value), so one set of CLI flags serves every source.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

from cxrdr.reinforce.phantom import PhantomSource
from cxrdr.reinforce.records import Record, SkipLog
from cxrdr.reinforce.sources.hidden import HiddenReports
from cxrdr.reinforce.sources.iu_xray import IuXraySource
from cxrdr.reinforce.sources.mimic import MimicSource
from cxrdr.reinforce.sources.nih_bbox import NihBboxSource
from cxrdr.reinforce.sources.tabular import TabularSource

log = logging.getLogger(__name__)

VALID_SPECS = ("phantom[:N]", "mimic:PATH.jsonl", "iu-xray:DIR", "nih-bbox:PATH.jsonl", "jsonl:PATH", "csv:PATH")
DEFAULT_PHANTOM_N = 200
_COLUMN_FLAGS = ("col_id", "col_image", "col_report", "col_findings", "col_impression", "col_labels",
                 "col_split", "col_subject", "col_study", "col_view", "col_triples", "col_boxes")
# Options each scheme understands, and the defaults at which an unused option is not worth a note.
_ACCEPTS = {
    "phantom": ("seed", "size", "split"),
    "mimic": ("image_root", "scene_graphs", "frontal_only", "min_report_chars", "label_order"),
    "iu-xray": ("image_root", "min_report_chars", "frontal_only"),
    "nih-bbox": ("image_root", "min_report_chars", "frontal_only"),
    "jsonl": ("image_root", "min_report_chars", "labels_format", "frontal_only") + _COLUMN_FLAGS,
    "csv": ("image_root", "min_report_chars", "labels_format", "frontal_only") + _COLUMN_FLAGS,
}
_QUIET_DEFAULTS = {"min_report_chars": 30, "seed": 0, "frontal_only": None, "labels_format": "auto"}


@runtime_checkable
class Source(Protocol):
    """What the build needs from a source."""

    name: str
    requires_images: bool
    skipped: SkipLog

    def __iter__(self) -> Iterator[Record]: ...

    def describe(self) -> dict: ...


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"bad source spec {spec!r}: {why}; valid specs: {', '.join(VALID_SPECS)}")


def parse_spec(spec: str) -> tuple[str, str]:
    """'iu-xray:/data/iu' -> ('iu-xray', '/data/iu'); 'phantom' -> ('phantom', '')."""
    spec = (spec or "").strip()
    scheme, _, arg = spec.partition(":")
    scheme = scheme.strip().lower()
    if scheme not in _ACCEPTS:
        raise _bad_spec(spec, f"unknown scheme {scheme!r}")
    if scheme != "phantom" and not arg.strip():
        raise _bad_spec(spec, f"{scheme} needs a path after ':'")
    return scheme, arg.strip()


def open_source(spec: str, **options) -> Source:
    """Open a source from its spec string (see the module docstring for specs and options)."""
    hide, hidden = options.pop("hide_reports", None), options.pop("hidden", None)
    if hide is not None or hidden is not None:
        return HiddenReports(open_source(spec, **options), 0.0 if hide is None else hide, hidden)
    scheme, arg = parse_spec(spec)
    given = {k: v for k, v in options.items() if v is not None}
    known = set().union(*_ACCEPTS.values())
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"unknown source option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    used = {k: v for k, v in given.items() if k in _ACCEPTS[scheme]}
    for key in sorted(set(given) - set(used)):
        if _QUIET_DEFAULTS.get(key, object()) != given[key]:
            log.info("source %s ignores option %s=%r", scheme, key, given[key])
    if scheme == "phantom":
        try:
            n = int(arg) if arg else DEFAULT_PHANTOM_N
        except ValueError:
            raise _bad_spec(spec, f"phantom count must be an integer, got {arg!r}") from None
        if n <= 0:
            raise _bad_spec(spec, "phantom count must be positive")
        return PhantomSource(n, seed=used.get("seed", 0), size=int(used.get("size", 256)), split=used.get("split"))
    if scheme == "mimic":
        return MimicSource(spec, Path(arg), **used)
    if scheme == "iu-xray":
        return IuXraySource(spec, Path(arg), **used)
    if scheme == "nih-bbox":
        return NihBboxSource(spec, Path(arg), **used)
    return TabularSource(spec, Path(arg), scheme, **used)


def parse_source_options(pairs: list[str] | None) -> dict:
    """CLI ``-o KEY=VALUE`` pairs -> open_source options (ints/bools converted, keys with '-' ok)."""
    out: dict = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"bad source option {pair!r}: expected KEY=VALUE")
        low = value.strip().lower()
        if key == "seed" and "," in value:  # phantom: several source seeds
            try:
                out[key] = [int(v) for v in value.split(",")]
            except ValueError:
                raise ValueError(f"bad source option {pair!r}: seed needs integers") from None
        elif key == "hide_reports":
            try:
                out[key] = float(value)
            except ValueError:
                raise ValueError(f"bad source option {pair!r}: hide_reports needs a fraction") from None
        elif key in ("min_report_chars", "seed", "size"):
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"bad source option {pair!r}: {key} needs an integer") from None
        elif key == "frontal_only":
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"bad source option {pair!r}: frontal_only needs true/false")
            out[key] = low in ("1", "true", "yes")
        else:
            out[key] = value.strip()
    return out


__all__ = ["Source", "open_source", "parse_spec", "parse_source_options", "VALID_SPECS"]
