"""Sources: spec parsing, mimic / iu-xray / jsonl / csv on small generated fixtures, and real shared data."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from PIL import Image

from cxrdr.reinforce.captions import make_captions
import cxrdr.reinforce.sources as reinforce_sources
from cxrdr.reinforce.records import load_image
from cxrdr.reinforce.sources import Source, open_source, parse_source_options
from cxrdr.reinforce.sources.mesh import coverage, mesh_to_annotations
from cxrdr.reinforce.sources.mimic import MIMIC_LABEL_ORDER

FINDINGS = "The heart is enlarged. There is a moderate right pleural effusion."
IMPRESSION = "Cardiomegaly and right effusion."


def _png(path: Path, size=(40, 32)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", size, 128).save(path)


def _write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row))
            fh.write("\n")
    return path


# --- specs ------------------------------------------------------------------------------------
def test_unknown_scheme_lists_valid_specs():
    with pytest.raises(ValueError, match=r"unknown scheme 'nope'.*phantom\[:N\].*mimic:PATH.jsonl.*iu-xray:DIR"):
        open_source("nope:/x")
    with pytest.raises(ValueError, match="needs a path"):
        open_source("jsonl:")
    with pytest.raises(ValueError, match="not found"):
        open_source("jsonl:/definitely/missing.jsonl")
    with pytest.raises(ValueError, match="unknown source option"):
        open_source("jsonl:/x.jsonl", colour="red")


def test_phantom_spec_passes_count_seed_and_size(monkeypatch):
    calls = {}

    class FakePhantom:
        def __init__(self, n, seed=0, size=256, split=None):
            calls.update(n=n, seed=seed, size=size, split=split)

    monkeypatch.setattr(reinforce_sources, "PhantomSource", FakePhantom)
    open_source("phantom:7", seed=3, size=64, min_report_chars=30, image_root=None)
    assert calls == {"n": 7, "seed": 3, "size": 64, "split": None}
    open_source("phantom:7", seed=[0, 1], split="test")
    assert calls["seed"] == [0, 1] and calls["split"] == "test"
    open_source("phantom")
    assert calls["n"] == 200
    with pytest.raises(ValueError, match="integer"):
        open_source("phantom:abc")


def test_parse_source_options():
    opts = parse_source_options(["col-report=notes", "min_report_chars=10", "frontal_only=true"])
    assert opts == {"col_report": "notes", "min_report_chars": 10, "frontal_only": True}
    assert parse_source_options(["seed=0,1", "split=test"]) == {"seed": [0, 1], "split": "test"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_source_options(["oops"])


# --- mimic ------------------------------------------------------------------------------------
@pytest.fixture()
def mimic_fixture(tmp_path):
    root = tmp_path / "files"
    for name in ("a", "b", "c", "d", "f"):
        _png(root / "p10" / "p10000001" / "s5001" / f"{name}.jpg")
    labels = [0] * 14
    labels[MIMIC_LABEL_ORDER.index("Cardiomegaly")] = 1
    labels[MIMIC_LABEL_ORDER.index("Pleural Effusion")] = 1
    base = {"subject_id": 10000001, "study_id": 5001, "split": "train", "labels": labels}
    rows = [
        {**base, "dicom_id": "a", "image_path": "p10/p10000001/s5001/a.jpg", "ViewPosition": "PA",
         "findings": FINDINGS, "impression": IMPRESSION},
        {**base, "dicom_id": "b", "image_path": "p10/p10000001/s5001/b.jpg", "ViewPosition": "AP",
         "query": f"{FINDINGS}|{IMPRESSION}", "split": "validate"},
        {**base, "dicom_id": "c", "image_path": "p10/p10000001/s5001/c.jpg", "ViewPosition": "LATERAL",
         "findings": FINDINGS},
        {**base, "dicom_id": "d", "image_path": "p10/p10000001/s5001/d.jpg", "ViewPosition": "PA",
         "findings": "Report to follow."},
        {**base, "dicom_id": "e", "image_path": "p10/p10000001/s5001/missing.jpg", "ViewPosition": "PA",
         "findings": FINDINGS},
        {**base, "dicom_id": "a", "image_path": "p10/p10000001/s5001/a.jpg", "ViewPosition": "PA",
         "findings": FINDINGS},
        "{not json",
        {**base, "dicom_id": "f", "image_path": "p10/p10000001/s5001/f.jpg", "ViewPosition": "PA",
         "findings": FINDINGS, "split": "test", "study_id": 5002},
    ]
    path = _write_jsonl(tmp_path / "mimic_master.jsonl", rows)
    graphs = {"a": [["pleural_effusion", "HAS_LOCATION", "right_hemithorax"]]}
    graph_path = tmp_path / "graphs.json"
    graph_path.write_text(json.dumps(graphs))
    imagenome = [{"image_id": "f", "study_id": "5002", "attributes": [
        {"bbox_name": "right lung", "attributes": [["anatomicalfinding|yes|lung opacity", "disease|no|pneumonia",
                                                    "nlp|yes|abnormal"]],
         "severity_cues": [["severity|yes|mild"]]}]}]
    imagenome_path = tmp_path / "imagenome.json"
    imagenome_path.write_text(json.dumps(imagenome))
    return path, root, graph_path, imagenome_path


def test_mimic_source(mimic_fixture):
    path, root, graph_path, _ = mimic_fixture
    src = open_source(f"mimic:{path}", image_root=str(root), scene_graphs=str(graph_path))
    assert isinstance(src, Source)
    records = list(src)
    assert [r.id for r in records] == ["a", "b", "f"]
    a, b, f = records
    assert a.split == "train" and b.split == "val" and f.split == "test"
    assert a.subject_id == "p10000001" and a.study_id == "s5001" and a.view == "PA"
    assert a.report == f"{FINDINGS} {IMPRESSION}" and b.report == a.report
    assert b.findings == FINDINGS and b.impression == IMPRESSION
    assert a.labels["Cardiomegaly"] == 1 and a.labels["Pleural Effusion"] == 1 and a.labels["Edema"] == 0
    assert a.triples == [("pleural_effusion", "HAS_LOCATION", "right_hemithorax")]
    assert f.triples == []
    assert load_image(a).size == (40, 32)
    reasons = {rid: reason.split(":")[0] for rid, reason in src.skipped.entries}
    assert reasons == {"d": "short report", "e": "missing image", "a": "duplicate id", "line 7": "bad json"}
    info = src.describe()
    json.dumps(info)
    assert info["counts"]["filtered"] == {"not frontal: LATERAL": 1}
    assert info["counts"]["by_split"] == {"train": 1, "val": 1, "test": 1}
    # re-iterable and deterministic: same records, same skip log (not doubled)
    assert [r.id for r in src] == ["a", "b", "f"] and len(src.skipped) == 4


def test_mimic_imagenome_scene_graph_layout(mimic_fixture):
    path, root, _, imagenome_path = mimic_fixture
    src = open_source(f"mimic:{path}", image_root=str(root), scene_graphs=str(imagenome_path))
    f = {r.id: r for r in src}["f"]
    assert set(f.triples) == {("lung_opacity", "HAS_LOCATION", "right_lung"),
                              ("lung_opacity", "IS_A", "anatomical_finding"),
                              ("lung_opacity", "HAS_SEVERITY", "mild")}
    assert src.describe()["records_with_scene_graph"] == 1


# --- iu-xray ----------------------------------------------------------------------------------
@pytest.fixture()
def iu_dir(tmp_path):
    rows = [
        {"study_id": "iu-1", "subject_id": "iu-1", "findings": FINDINGS, "impression": IMPRESSION,
         "report": f"{FINDINGS} {IMPRESSION}", "mesh": ["Cardiomegaly/mild", "Pleural Effusion/right/moderate"],
         "problems": [], "split": "train",
         "source_images": [{"file": "1_IM-0001-3001.dcm.png", "view": "lateral"},
                           {"file": "1_IM-0001-4001.dcm.png", "view": "frontal"}]},
        {"study_id": "iu-2", "subject_id": "iu-2", "findings": "", "impression": "Normal chest x-XXXX. No disease.",
         "report": "Normal chest x-XXXX. No disease at all here.", "mesh": ["normal"], "split": "val",
         "source_images": [{"file": "2_IM-0002-1001.dcm.png", "view": "frontal"}]},
        {"study_id": "iu-3", "subject_id": "iu-3", "findings": "", "impression": "Short.", "report": "Short.",
         "mesh": ["No Indexing"], "split": "test", "source_images": []},
    ]
    _write_jsonl(tmp_path / "iu_xray_reports.jsonl", rows)
    images = tmp_path / "pngs"
    _png(images / "1_IM-0001-4001.dcm.png")
    _png(images / "1_IM-0001-3001.dcm.png", size=(20, 20))
    return tmp_path, images


def test_iu_xray_text_only_and_with_images(iu_dir):
    folder, images = iu_dir
    src = open_source(f"iu-xray:{folder}")
    assert src.requires_images is False
    records = list(src)
    assert [r.id for r in records] == ["iu-1", "iu-2"] and records[0].image is None
    assert dict(src.skipped.entries) == {"iu-3": "short report: 6 chars < 30"}
    r1, r2 = records
    assert ("pleural_effusion", "HAS_LOCATION", "right_hemithorax") in r1.triples
    assert ("pleural_effusion", "HAS_SEVERITY", "moderate") in r1.triples
    assert ("cardiomegaly", "HAS_SEVERITY", "mild") in r1.triples
    assert r1.labels["Cardiomegaly"] == 1 and r1.labels["Pleural Effusion"] == 1 and r1.labels["No Finding"] == 0
    assert r2.triples == [] and r2.labels == {"No Finding": 1}
    assert src.describe()["mesh"]["term_coverage"] == 1.0

    with_images = open_source(f"iu-xray:{folder}", image_root=str(images))
    assert with_images.requires_images is True
    records = list(with_images)
    assert [r.id for r in records] == ["iu-1"]
    assert Path(records[0].image).name == "1_IM-0001-4001.dcm.png" and records[0].view == "frontal"
    assert load_image(records[0]).size == (40, 32)
    reasons = dict(with_images.skipped.entries)
    assert reasons["iu-2"].startswith("missing image:")


def test_mesh_mapping_rules():
    a = mesh_to_annotations(["Opacity/lung/base/left/mild"])
    b = mesh_to_annotations(["Opacity/mild/left/base/lung"])
    assert set(a.triples) == set(b.triples) == {("lung_opacity", "HAS_LOCATION", "left_lung_base"),
                                                ("lung_opacity", "HAS_SEVERITY", "mild"),
                                                ("lung_opacity", "IS_A", "parenchymal_opacity")}
    assert a.labels == {"Lung Opacity": 1, "No Finding": 0}
    unknown = mesh_to_annotations(["Strange Thing/right/weird"])
    assert ("strange_thing", "IS_A", "unclassified_finding") in unknown.triples
    assert ("strange_thing", "HAS_LOCATION", "right_lung") in unknown.triples
    assert unknown.unmapped_terms == ["strange thing"] and unknown.unmapped_qualifiers == ["weird"]
    assert mesh_to_annotations(["No Indexing"]).triples == [] and mesh_to_annotations(["No Indexing"]).labels == {}
    assert mesh_to_annotations(["normal"]).labels == {"No Finding": 1}
    blunted = mesh_to_annotations(["Costophrenic Angle/left/blunted"])
    assert blunted.labels["Pleural Effusion"] == -1 and blunted.labels["No Finding"] == 0


# --- generic jsonl / csv ----------------------------------------------------------------------
def test_jsonl_reads_phantom_style_records(tmp_path):
    _png(tmp_path / "images" / "ph-0.png")
    _png(tmp_path / "images" / "ph-1.png")
    row = {"id": "ph-0", "subject_id": "s0", "study_id": "st0", "split": "train", "report": FINDINGS,
           "image": "images/ph-0.png", "view": "PA", "findings": FINDINGS, "impression": "",
           "labels": {"Cardiomegaly": 1, "Edema": 0}, "triples": [["cardiomegaly", "IS_A", "cardiac_abnormality"]],
           "boxes": [{"label": "cardiomegaly", "box": [1, 2, 30, 20]}], "extra": {"seed": 0}}
    row1 = {**row, "id": "ph-1", "image": "images/ph-1.png", "labels": ["Edema"], "split": "val", "report": ""}
    path = _write_jsonl(tmp_path / "records.jsonl", [row, row1, {**row, "id": "ph-2", "image": "images/no.png"}])
    src = open_source(f"jsonl:{path}")
    records = list(src)
    assert [r.id for r in records] == ["ph-0", "ph-1"]
    r0, r1 = records
    assert r0.labels == {"Cardiomegaly": 1, "Edema": 0}
    assert r0.triples == [("cardiomegaly", "IS_A", "cardiac_abnormality")]
    assert r0.boxes == [{"label": "cardiomegaly", "box": [1, 2, 30, 20]}]
    assert r1.labels == {"Edema": 1} and r1.report == FINDINGS  # report from findings + impression
    assert dict(src.skipped.entries)["ph-2"].startswith("missing image:")
    assert load_image(r0).mode == "L"


def test_csv_with_column_flags(tmp_path):
    _png(tmp_path / "imgs" / "x1.png")
    _png(tmp_path / "imgs" / "x2.png")
    path = tmp_path / "table.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["uid", "file", "notes", "Cardiomegaly", "Edema", "patient", "fold"])
        w.writerow(["x1", "x1.png", FINDINGS, "1.0", "", "p1", "validate"])
        w.writerow(["x2", "x2.png", FINDINGS, "-1", "0", "p2", "nonsense"])
        w.writerow(["x3", "x3.png", "", "0", "0", "p3", "train"])
    src = open_source(f"csv:{path}", image_root=str(tmp_path / "imgs"), col_id="uid", col_image="file",
                      col_report="notes", col_subject="patient", col_split="fold", labels_format="columns",
                      col_labels="Cardiomegaly,Edema")
    records = list(src)
    assert [r.id for r in records] == ["x1"]
    assert records[0].labels == {"Cardiomegaly": 1, "Edema": None} and records[0].split == "val"
    assert records[0].subject_id == "p1" and records[0].study_id == "x1"
    by_reason = src.skipped.by_reason()
    # x3 has labels but no report: it gets a text composed from them (text_source: labels), then its image is missing
    assert by_reason == {"bad split": 1, "missing image": 1}


# --- real shared data -------------------------------------------------------------------------
def test_real_iu_xray_triples_labels_and_captions(shared_data):
    src = open_source(f"iu-xray:{shared_data / 'iu_xray'}")
    n = with_findings = 0
    for rec in src:
        n += 1
        codes = {c for c in rec.extra["mesh"]}
        if codes - {"normal", "No Indexing"}:
            with_findings += 1
            assert rec.triples, rec.id
            assert rec.labels, rec.id
        captions = make_captions(rec, n=5, seed=0)
        assert len(captions) == 5 and all(c.text.strip() for c in captions), rec.id
    assert n == 3739 and with_findings > 2000
    info = src.describe()
    assert info["mesh"]["term_coverage"] >= 0.95


def test_real_mesh_coverage(shared_data):
    with open(shared_data / "iu_xray" / "iu_xray_reports.jsonl", encoding="utf-8") as fh:
        cov = coverage(json.loads(line)["mesh"] for line in fh)
    assert cov["term_coverage"] >= 0.95 and cov["qualifier_coverage"] >= 0.95


def test_real_covid_jsonl_every_row_with_image(shared_data):
    src = open_source(f"jsonl:{shared_data / 'covid_cxr' / 'covid_cxr.jsonl'}", col_boxes="lung_boxes")
    records = list(src)
    assert len(records) == 284 and len(src.skipped) == 0
    assert {r.split for r in records} == {"train", "val", "test"}
    for rec in records:
        assert load_image(rec).mode == "L"
    with_boxes = [r for r in records if r.boxes]
    assert with_boxes and all(len(b["box"]) == 4 for r in with_boxes for b in r.boxes)
    assert any(r.labels.get("COVID-19") == 1 for r in records)


def test_jsonl_reads_back_phantom_records_jsonl(tmp_path):
    phantom = pytest.importorskip("cxrdr.reinforce.phantom")
    write = getattr(phantom, "write_phantom_dataset", None)
    if write is None:
        pytest.skip("cxrdr.reinforce.phantom.write_phantom_dataset not available")
    write(6, tmp_path, 0, 64)
    direct = {r.id: r for r in open_source("phantom:6", seed=0, size=64)}
    src = open_source(f"jsonl:{tmp_path / 'records.jsonl'}")
    records = list(src)
    assert len(records) == 6 and len(src.skipped) == 0
    for rec in records:
        want = direct[rec.id]
        assert (rec.split, rec.report, rec.subject_id, rec.study_id) == \
            (want.split, want.report, want.subject_id, want.study_id)
        assert [tuple(t) for t in rec.triples] == [tuple(t) for t in want.triples]
        assert {k: v for k, v in rec.labels.items()} == {k: v for k, v in want.labels.items()}
        assert len(rec.boxes) == len(want.boxes)
        assert load_image(rec).size == (64, 64)


# --- decoding for the store -----------------------------------------------------------------------
def _radiograph_jpeg(path: Path, size=(600, 720)) -> Path:
    """A smooth gradient with a little noise and a bright disc: compresses like a radiograph."""
    import numpy as np

    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    img = 60 + 120 * x / w + 40 * ((x - w / 2) ** 2 + (y - h / 3) ** 2 < (w / 6) ** 2)
    img = img + np.random.default_rng(0).normal(0, 2, (h, w))
    Image.fromarray(np.clip(img, 0, 255).astype("uint8")).save(path, format="JPEG", quality=95)
    return path


def test_a_large_jpeg_is_decoded_reduced_for_the_store_and_keeps_its_source_size(tmp_path):
    import numpy as np

    from cxrdr.common.augment import resize_short_side
    from cxrdr.reinforce.records import JPEG_DRAFT_GAP, Record, load_image_for_store

    path = _radiograph_jpeg(tmp_path / "big.jpg")
    rec = Record(id="big", subject_id="s", study_id="t", split="train", report="", image=path)
    whole = load_image(rec)
    reduced, source_size = load_image_for_store(rec, 64)
    assert source_size == whole.size == (600, 720)  # boxes are in the source's pixels
    assert reduced.mode == "L" and reduced.size == (150, 180)  # 1/4 scale: the coarsest keeping >= 2 x 64
    assert min(reduced.size) >= JPEG_DRAFT_GAP * 64
    a = np.asarray(resize_short_side(reduced, 64), dtype=np.int16)
    b = np.asarray(resize_short_side(whole, 64), dtype=np.int16)
    assert a.shape == b.shape == (77, 64)
    assert np.abs(a - b).max() <= 4 and np.abs(a - b).mean() < 0.5
    # stored at nearly its own size: decoded whole
    assert load_image_for_store(rec, 400)[0].size == (600, 720)


def test_only_a_jpeg_is_decoded_reduced_for_the_store(tmp_path):
    import numpy as np

    from cxrdr.reinforce.records import Record, load_image_for_store

    Image.open(_radiograph_jpeg(tmp_path / "big.jpg")).save(tmp_path / "big.png")
    rec = Record(id="png", subject_id="s", study_id="t", split="train", report="", image=tmp_path / "big.png")
    image, source_size = load_image_for_store(rec, 64)
    assert source_size == image.size == (600, 720)
    assert np.array_equal(np.asarray(image), np.asarray(load_image(rec)))


def test_prepared_boxes_scale_from_the_jpeg_source_not_the_reduced_decode(tmp_path):
    from cxrdr.common.augment import AugConfig
    from cxrdr.reinforce.prepare import PrepareSpec, prepare_record
    from cxrdr.reinforce.records import Record

    path = _radiograph_jpeg(tmp_path / "big.jpg")
    rec = Record(id="big", subject_id="s", study_id="t", split="train", report="Right effusion.",
                 image=path, boxes=[{"label": "Effusion", "box": [60, 72, 300, 360]}])
    spec = PrepareSpec(images=True, store_size=64, image_format="jpg", jpeg_quality=95, n_aug=1, n_captions=1,
                       aug=AugConfig(), seed=0, sizes=(32,))
    prepared = prepare_record(0, "000000", rec, spec)
    assert "skip" not in prepared, prepared.get("skip")
    meta = json.loads(prepared["meta"]) if isinstance(prepared["meta"], (str, bytes)) else prepared["meta"]
    assert meta["image_size"] == [64, 77]
    assert [(b["label"], b["box"]) for b in meta["boxes"]] == [("Effusion", [6.4, 7.7, 32.0, 38.5])]
