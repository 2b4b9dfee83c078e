"""``mimic:PATH.jsonl`` — the Patch-IB-CXR MIMIC-CXR master JSONL, with optional ImaGenome triples.

Row fields accepted (first present alias wins):
- image: ``image_path`` | ``image`` | ``path`` | ``jpg_path`` — relative to ``image_root`` (e.g.
  ``/datasets/MIMIC-CXR/files``), else to the JSONL's folder; absolute paths are kept.
- text: ``findings`` + ``impression`` when present, else ``report`` | ``text`` | ``query`` (the master
  file's ``query`` is ``findings|impression``: '|' separates the sections).
- ids: ``dicom_id`` | ``image_id`` | ``id`` (else the image file stem); ``subject_id``; ``study_id``
  (MIMIC's numeric ids are prefixed: ``p10000032``, ``s50414267`` unless already prefixed).
- view: ``view`` | ``ViewPosition`` | ``view_position``; with ``frontal_only`` (default) only AP/PA
  rows are kept (rows without a view are kept: the master file is frontal-only already).
- split: ``split`` (official: train / validate -> 'val' / test).
- labels: a dict CheXpert name -> value; or a list of 14 values in ``label_order`` 'mimic'
  (alphabetical, the column order of mimic-cxr-2.0.0-chexpert.csv, default) or 'chexpert'
  (``cxrdr.common.labels.CHEXPERT14`` order); or CheXpert-named top-level columns.
Reports under ``min_report_chars`` (30) are skipped, as the master file's own filter did.

Scene graphs (``scene_graphs=PATH``): Chest ImaGenome triples joined on dicom id or study id.
Accepted layouts:
1. a JSON dict ``{id: [[s, p, o], ...]}`` (id = dicom id or study id, with or without the 's' prefix);
2. a JSON dict ``{id: scene_graph}`` or a JSON list of scene graphs, or a folder of
   ``*_SceneGraph.json`` files, where a scene graph is ImaGenome's layout:
   ``{"image_id", "study_id", "attributes": [{"bbox_name": "right lung", "attributes":
   [["anatomicalfinding|yes|lung opacity", "disease|no|pneumonia", ...], ...],
   "severity_cues": [["severity|yes|mild"], ...], ...}]}``. Each ``yes`` attribute becomes
   ``(finding, HAS_LOCATION, bbox_name)`` and ``(finding, IS_A, category)``
   (anatomicalfinding -> anatomical_finding, disease, tubesandlines -> device, ...); severity cues of
   the same phrase give ``HAS_SEVERITY``. ``no`` attributes (negations) and ``nlp|...`` normal/abnormal
   tags are not findings and give no triple. Names are snake_cased.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

from cxrdr.common.labels import CHEXPERT14
from cxrdr.common.views import is_frontal
from cxrdr.reinforce.records import Record, Triple
from cxrdr.reinforce.sources.common import (BaseSource, Skip, join_report, normalize_split, read_jsonl,
                                      require_file, resolve_image, text)
from cxrdr.reinforce.sources.tabular import label_value

# Column order of mimic-cxr-2.0.0-chexpert.csv (alphabetical), used by 14-value label lists.
MIMIC_LABEL_ORDER = ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Enlarged Cardiomediastinum",
                     "Fracture", "Lung Lesion", "Lung Opacity", "No Finding", "Pleural Effusion",
                     "Pleural Other", "Pneumonia", "Pneumothorax", "Support Devices")
_CATEGORY = {"anatomicalfinding": "anatomical_finding", "disease": "disease", "tubesandlines": "device",
             "devices": "device", "technicalassessment": "technical", "texture": "texture"}


def _first(row: dict, *keys):
    for key in keys:
        if key in row and row[key] not in (None, ""):
            return row[key]
    return None


def _snake(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", str(name).lower()).strip("_")


def _prefixed(value, prefix: str) -> str:
    s = text(value)
    if s.endswith(".0"):
        s = s[:-2]
    return s if not s or not s.isdigit() else prefix + s


def scene_graph_triples(graph: dict) -> list[Triple]:
    """ImaGenome scene graph -> triples (see module docstring)."""
    out: list[Triple] = []
    for entry in graph.get("attributes", []) or []:
        region = _snake(entry.get("bbox_name") or entry.get("name") or "")
        per_phrase = entry.get("attributes") or []
        severities = entry.get("severity_cues") or []
        for i, phrase_attrs in enumerate(per_phrase):
            phrase_attrs = [phrase_attrs] if isinstance(phrase_attrs, str) else phrase_attrs
            found = []
            for item in phrase_attrs:
                parts = str(item).split("|")
                if len(parts) != 3 or parts[1].strip().lower() != "yes" or parts[0] == "nlp":
                    continue
                finding = _snake(parts[2])
                found.append(finding)
                if region:
                    out.append((finding, "HAS_LOCATION", region))
                out.append((finding, "IS_A", _CATEGORY.get(parts[0].strip().lower(), _snake(parts[0]))))
            cues = severities[i] if i < len(severities) else []
            cues = [cues] if isinstance(cues, str) else cues
            for cue in cues or []:
                parts = str(cue).split("|")
                if len(parts) == 3 and parts[1].strip().lower() == "yes":
                    out.extend((f, "HAS_SEVERITY", _snake(parts[2])) for f in found)
    return list(dict.fromkeys(out))


def load_scene_graphs(path: str | Path) -> dict[str, list[Triple]]:
    """Any accepted scene-graph layout -> {id: triples}, keyed by every id a graph names."""
    path = Path(path).expanduser()
    if path.is_dir():
        graphs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(path.glob("*.json"))]
        data: object = graphs
    elif path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
    else:
        raise ValueError(f"scene graphs not found: {path}")
    table: dict[str, list[Triple]] = {}

    def put(key, triples):
        key = text(key)
        if key:
            table.setdefault(key, []).extend(t for t in triples if t not in table.get(key, []))

    items = data.items() if isinstance(data, dict) else ((None, g) for g in data)  # type: ignore[union-attr]
    for key, value in items:
        if isinstance(value, list):  # id -> [[s, p, o], ...]
            bad = [v for v in value if not (isinstance(v, (list, tuple)) and len(v) == 3)]
            if bad:
                raise ValueError(f"scene graphs {path}: entry {key!r} is not a list of [s, p, o]: {bad[0]!r}")
            put(key, [tuple(str(x) for x in v) for v in value])
        elif isinstance(value, dict):
            triples = scene_graph_triples(value)
            for k in {key, value.get("image_id"), value.get("dicom_id"), value.get("study_id")}:
                put(k, triples)
        else:
            raise ValueError(f"scene graphs {path}: unsupported entry {key!r} ({type(value).__name__})")
    return table


class MimicSource(BaseSource):
    name = "mimic"

    def __init__(self, spec: str, path: str | Path, image_root: str | Path | None = None,
                 scene_graphs: str | Path | None = None, frontal_only: bool = True,
                 min_report_chars: int = 30, label_order: str = "mimic"):
        super().__init__(spec, min_report_chars)
        self.path = require_file(path, "MIMIC master JSONL")
        self.image_root = Path(image_root).expanduser() if image_root else None
        if self.image_root is not None and not self.image_root.is_dir():
            raise ValueError(f"image root not found: {self.image_root}")
        self.frontal_only = bool(frontal_only)
        if label_order not in ("mimic", "chexpert"):
            raise ValueError(f"label_order must be 'mimic' or 'chexpert', got {label_order!r}")
        self.label_order = MIMIC_LABEL_ORDER if label_order == "mimic" else CHEXPERT14
        self.scene_graphs_path = str(scene_graphs) if scene_graphs else None
        self.scene_graphs = load_scene_graphs(scene_graphs) if scene_graphs else {}
        self.with_graph = 0

    def _options(self) -> dict:
        return {"path": str(self.path), "image_root": str(self.image_root) if self.image_root else None,
                "scene_graphs": self.scene_graphs_path, "frontal_only": self.frontal_only}

    def _extra_description(self) -> dict:
        return {"scene_graph_ids": len(self.scene_graphs), "records_with_scene_graph": self.with_graph}

    def _labels(self, row: dict, rid: str) -> dict[str, int | None]:
        value = row.get("labels")
        if isinstance(value, dict):
            return {str(k): label_value(v) for k, v in value.items()}
        if isinstance(value, list) and value and all(not isinstance(v, str) for v in value):
            if len(value) != len(self.label_order):
                raise ValueError(f"labels list has {len(value)} values, expected 14")
            return {name: label_value(v) for name, v in zip(self.label_order, value)}
        if isinstance(value, list):
            return {str(name): 1 for name in value}
        return {name: label_value(row[name]) for name in CHEXPERT14 if name in row}

    def _candidates(self) -> Iterator[Record | Skip]:
        base = self.image_root or self.path.parent
        self.with_graph = 0
        for lineno, row in read_jsonl(self.path):
            if isinstance(row, Skip):
                yield row
                continue
            image = resolve_image(_first(row, "image_path", "image", "path", "jpg_path"), base)
            rid = text(_first(row, "dicom_id", "image_id", "id")) or (Path(image).stem if image else "") \
                or f"line {lineno}"
            view = text(_first(row, "view", "ViewPosition", "view_position")) or None
            if self.frontal_only and view is not None and not is_frontal(view):
                self.filtered[f"not frontal: {view}"] += 1
                continue
            findings, impression = text(row.get("findings")), text(row.get("impression"))
            if findings or impression:
                report = join_report(findings, impression)
            else:
                raw = text(_first(row, "report", "text", "query"))
                sections = [s.strip() for s in raw.split("|")]
                if len(sections) == 2:
                    findings, impression = sections
                report = join_report(*sections[:1], " ".join(sections[1:])) if sections else ""
            split = normalize_split(row.get("split"))
            if split is None:
                yield Skip(rid, f"bad split: {row.get('split')!r} at line {lineno}")
                continue
            try:
                labels = self._labels(row, rid)
            except ValueError as exc:
                yield Skip(rid, f"bad row: line {lineno}: {exc}")
                continue
            study = _prefixed(row.get("study_id"), "s")
            subject = _prefixed(row.get("subject_id"), "p") or study or rid
            triples: list[Triple] = []
            for key in (rid, study, study[1:] if study.startswith("s") else None):
                if key and key in self.scene_graphs:
                    triples = list(self.scene_graphs[key])
                    break
            self.with_graph += bool(triples)
            extra = {k: row[k] for k in ("dicom_id", "ViewPosition") if k in row}
            yield Record(id=rid, subject_id=subject, study_id=study or rid, split=split, report=report,
                         image=image, view=view, findings=findings, impression=impression, labels=labels,
                         triples=triples, extra=extra)
