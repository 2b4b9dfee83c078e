"""``iu-xray:DIR`` — Open-i Indiana University reports (shared/data/iu_xray layout), MeSH -> triples.

DIR holds ``iu_xray_reports.jsonl`` (a path to the .jsonl itself works too); one row per study:
``study_id, subject_id, findings, impression, report, mesh, problems, indication, comparison,
source_images [{"file", "view"}], split``. MeSH codes become triples and CheXpert-style labels
through ``cxrdr.reinforce.sources.mesh`` (see its table).

- Without ``image_root`` the source is text-only: ``image=None``, ``requires_images=False``;
  triples, labels and captions still work.
- With ``image_root=DIR`` holding the Open-i PNGs, each study yields one image record: the first
  frontal image of ``source_images`` found under DIR (a lateral one only if no frontal exists
  and ``frontal_only`` is off). File names are tried as given (Kaggle ``1_IM-0001-4001.dcm.png``),
  without ``.dcm`` and with R2Gen's ``CXR`` prefix. A study with none found is skipped
  ("missing image: ...").
Unmapped MeSH head terms/qualifiers are counted per pass (``describe()['mesh']``).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterator

from cxrdr.reinforce.records import Record
from cxrdr.reinforce.sources.common import BaseSource, Skip, join_report, normalize_split, read_jsonl, text
from cxrdr.reinforce.sources.mesh import mesh_to_annotations

REPORTS_FILE = "iu_xray_reports.jsonl"


def _name_variants(name: str) -> list[str]:
    plain = name.replace(".dcm.png", ".png")
    return list(dict.fromkeys([name, plain, f"CXR{plain}", f"CXR{name}"]))


class IuXraySource(BaseSource):
    name = "iu-xray"

    def __init__(self, spec: str, path: str | Path, image_root: str | Path | None = None,
                 min_report_chars: int = 30, frontal_only: bool = True):
        super().__init__(spec, min_report_chars)
        path = Path(path).expanduser()
        self.path = path / REPORTS_FILE if path.is_dir() else path
        if not self.path.is_file():
            raise ValueError(f"IU X-ray reports not found: {self.path} (expected DIR/{REPORTS_FILE})")
        self.image_root = Path(image_root).expanduser() if image_root else None
        if self.image_root is not None and not self.image_root.is_dir():
            raise ValueError(f"image root not found: {self.image_root}")
        self.requires_images = self.image_root is not None
        self.frontal_only = bool(frontal_only)
        self.mesh_stats: dict = {}

    def _options(self) -> dict:
        return {"path": str(self.path), "image_root": str(self.image_root) if self.image_root else None,
                "frontal_only": self.frontal_only}

    def _extra_description(self) -> dict:
        return {"mesh": self.mesh_stats}

    def _find_image(self, source_images: list[dict]) -> tuple[str | None, str | None, str]:
        """(path, view, what was tried) of the preferred existing image."""
        assert self.image_root is not None
        ordered = sorted(source_images, key=lambda s: text(s.get("view")).lower() != "frontal")
        tried = []
        for item in ordered:
            view = text(item.get("view")).lower() or None
            if self.frontal_only and view != "frontal":
                continue
            for name in _name_variants(text(item.get("file"))):
                candidate = self.image_root / name
                if candidate.is_file():
                    return str(candidate), view, ""
            tried.append(text(item.get("file")))
        return None, None, ", ".join(tried) or "no frontal image listed"

    def _candidates(self) -> Iterator[Record | Skip]:
        terms = mapped = studies_with_findings = 0
        unmapped_terms: Counter = Counter()
        unmapped_quals: Counter = Counter()
        for lineno, row in read_jsonl(self.path):
            if isinstance(row, Skip):
                yield row
                continue
            rid = text(row.get("study_id")) or f"line {lineno}"
            findings, impression = text(row.get("findings")), text(row.get("impression"))
            report = text(row.get("report")) or join_report(findings, impression)
            split = normalize_split(row.get("split"))
            if split is None:
                yield Skip(rid, f"bad split: {row.get('split')!r} at line {lineno}")
                continue
            mesh = [text(m) for m in row.get("mesh") or [] if text(m)]
            ann = mesh_to_annotations(mesh)
            terms += ann.n_terms
            mapped += ann.mapped_terms
            unmapped_terms.update(ann.unmapped_terms)
            unmapped_quals.update(ann.unmapped_qualifiers)
            studies_with_findings += bool(ann.findings)
            image = view = None
            if self.image_root is not None:
                image, view, tried = self._find_image(row.get("source_images") or [])
                if image is None:
                    yield Skip(rid, f"missing image: none of [{tried}] under {self.image_root}")
                    continue
            extra = {"mesh": mesh, "problems": row.get("problems") or [],
                     "indication": text(row.get("indication")), "comparison": text(row.get("comparison")),
                     "source_images": row.get("source_images") or []}
            if ann.unmapped_terms:
                extra["unmapped_mesh"] = ann.unmapped_terms
            yield Record(id=rid, subject_id=text(row.get("subject_id")) or rid, study_id=rid, split=split,
                         report=report, image=image, view=view, findings=findings, impression=impression,
                         labels=ann.labels, triples=ann.triples, extra=extra)
        self.mesh_stats = {"terms": terms, "mapped_terms": mapped,
                           "term_coverage": round(mapped / terms, 4) if terms else 1.0,
                           "studies_with_findings": studies_with_findings,
                           "unmapped_terms": dict(unmapped_terms.most_common(50)),
                           "unmapped_qualifiers": dict(unmapped_quals.most_common(50))}
