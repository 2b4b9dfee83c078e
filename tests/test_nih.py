"""NIH ChestX-ray14 box subset: the nih-bbox source, reports composed from labels, the box benchmark, init_ckpt."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from cxrdr.common.augment import full_image_params
from cxrdr.common.nih import canonical_finding, chexpert_labels
from cxrdr.experiments.recipe_file import expand_env
from cxrdr.reinforce.captions.from_labels import compose_report, report_from_labels
from cxrdr.reinforce.card import dataset_card
from cxrdr.reinforce.sources import open_source
from cxrdr.train.checkpoint import init_from_checkpoint, save_checkpoint
from cxrdr.train.evaluation.benchmark import boxloc, run_benchmark
from cxrdr.train.models import build_student


def _png(path, size=64, value=90):
    Image.fromarray(np.full((size, size), value, np.uint8)).save(path)


def _nih_file(tmp_path, rows):
    (tmp_path / "images").mkdir(exist_ok=True)
    for r in rows:
        _png(tmp_path / r["image"], value=40 + 30 * len(r["boxes"]))
    path = tmp_path / "nih_bbox.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _row(i, split, labels, boxes):
    return {"image": f"images/{i}.png", "id": str(i), "subject_id": f"nih-{i}", "study_id": f"s{i}",
            "split": split, "view": "frontal", "labels": labels, "boxes": boxes}


ROWS = [_row(0, "train", ["Infiltration", "Effusion"], [{"label": "Infiltrate", "box": [4, 4, 30, 40]}]),
        _row(1, "train", ["Nodule"], [{"label": "Nodule", "box": [40, 10, 46, 16]}]),
        _row(2, "test", ["Cardiomegaly"], [{"label": "Cardiomegaly", "box": [20, 30, 50, 56]}]),
        _row(3, "test", ["Effusion", "Atelectasis"], [{"label": "Effusion", "box": [2, 40, 30, 62]},
                                                       {"label": "Atelectasis", "box": [36, 40, 60, 50]}]),
        _row(4, "test", [], [])]


def test_label_names_are_one_finding_and_map_to_chexpert():
    assert canonical_finding("Infiltration") == canonical_finding("Infiltrate") == "Infiltrate"
    assert canonical_finding("pleural_effusion") == "Effusion"
    labels = chexpert_labels(["Mass", "Infiltration"])
    assert labels["Lung Lesion"] == 1 and labels["Lung Opacity"] == 1 and labels["Pneumothorax"] == 0
    assert labels["No Finding"] == 0 and "Fracture" not in labels
    assert chexpert_labels([])["No Finding"] == 1


def test_composed_report_states_positives_and_negatives():
    text = compose_report(["cardiomegaly", "pleural effusion"], ["pneumothorax", "mass"])
    assert text == "Findings of cardiomegaly and pleural effusion. No pneumothorax or mass."
    assert report_from_labels({"Edema": 1, "Pneumothorax": 0, "Fracture": None})[0] == \
        "Findings of edema. No pneumothorax."
    assert report_from_labels({"Fracture": None}) is None  # nothing asserted: nothing to compose
    assert report_from_labels({"No Finding": 1})[0].startswith("No acute")
    assert report_from_labels({"Edema": 0})[0] == "No edema."  # all-negative labels do not claim a normal study


def test_nih_source_composes_marked_text_and_keeps_boxes(tmp_path):
    source = open_source(f"nih-bbox:{_nih_file(tmp_path, ROWS)}")
    recs = {r.id: r for r in source}
    r0 = recs["0"]
    assert r0.split == "train" and r0.extra["text_source"] == "labels"
    assert r0.report.startswith("Findings of infiltrate and pleural effusion.") and "No atelectasis" in r0.report
    assert r0.boxes == [{"label": "Infiltrate", "box": [4.0, 4.0, 30.0, 40.0]}]
    assert ("infiltrate", "HAS_STATUS", "present") in r0.triples
    assert recs["4"].labels["No Finding"] == 1 and recs["4"].report.startswith("No acute")
    assert source.counts["text_source"] == {"labels": 5}
    card = dataset_card({"source": source.describe(), "shards": [], "counts": {}})
    assert "5 samples have no report" in card and "CC0-1.0" in card


def test_rows_with_labels_but_no_report_get_labels_text_others_are_skipped(tmp_path):
    _png(tmp_path / "a.png")
    rows = [{"id": "a", "image": "a.png", "labels": {"Cardiomegaly": 1, "Edema": 0}, "split": "train"},
            {"id": "b", "image": "a.png", "split": "train"},
            {"id": "c", "image": "a.png", "report": "Real report text of a radiologist, long enough.",
             "labels": {"Edema": 1}, "split": "train"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    source = open_source(f"jsonl:{path}")
    recs = {r.id: r for r in source}
    assert recs["a"].report == "Findings of cardiomegaly. No edema." and recs["a"].extra["text_source"] == "labels"
    assert "text_source" not in recs["c"].extra and recs["c"].report.startswith("Real report")
    assert "b" not in recs and source.skipped.by_reason() == {"empty report": 1}
    assert source.counts["text_source"] == {"labels": 1, "report": 1}


def test_iobb_heat_box_and_leave_one_out_prior():
    params = full_image_params(120, 120)
    heat = np.zeros((12, 12))
    heat[2:4, 5:7] = 1.0  # a 2x2-patch blob: pixels x 50-70, y 20-40
    assert boxloc.heat_box(heat, params) == pytest.approx([50, 20, 70, 40])
    assert boxloc.iobb([50, 20, 70, 40], [0, 0, 60, 120]) == pytest.approx(0.5)
    scores = boxloc.score_map(heat, np.pad(np.ones((2, 2), bool), ((2, 8), (5, 5))), [[50, 20, 70, 40]], params)
    assert scores["hit"] == 1.0 and scores["iobb_0.5"] == 1.0
    assert [m.tolist() for m in boxloc.loo_means([np.ones((1, 1)), np.zeros((1, 1)), np.ones((1, 1))])] == \
        [[[0.5]], [[1.0]], [[0.5]]]


def test_benchmark_writes_summary_tables_and_heatmaps(tmp_path, one_thread):
    torch.manual_seed(0)
    student = build_student("tiny-D").eval()
    out = tmp_path / "bench"
    res = run_benchmark(student, f"nih-bbox:{_nih_file(tmp_path, ROWS)}", "test", out, progress=False, n_plots=2)
    s = res["summary"]
    assert s["n_images"] == 3 and s["n_boxes"] == 3 and s["n_targets_attention"] == 3 and s["n_targets_z"] == 2
    for key in ("zero_shot_auc_mean", "pg_attention", "pg_attention_chance", "pg_attention_prior", "pg_z",
                "pg_z_chance", "pg_z_prior", "pg_z_train_prior", "pg_attention_train_prior", "iobb_0.5_z"):
        assert key in s
    assert 0 < s["pg_z_chance"] < 1 and 0 <= s["pg_attention"] <= 1
    assert set(res["zeroshot"]["per_finding"]) == {"Atelectasis", "Cardiomegaly", "Effusion"}  # 0 < positives < n
    assert res["zeroshot"]["prompts"]["Effusion"]["positive"][0] == "pleural effusion."
    assert (out / "benchmark.json").is_file() and (out / "heatmaps.png").is_file()
    assert "| **overall** |" in (out / "benchmark.md").read_text()


def test_init_ckpt_loads_weights_and_refuses_another_architecture(tmp_path):
    torch.manual_seed(0)
    a = build_student("tiny-D")
    save_checkpoint(tmp_path / "a.pt", a)
    b = build_student("tiny-D")
    info = init_from_checkpoint(b, tmp_path / "a.pt")
    assert info["tensors"] == len(a.state_dict())
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    with pytest.raises(ValueError, match="not the run's architecture"):
        init_from_checkpoint(build_student("tiny-A"), tmp_path / "a.pt")


def test_recipe_paths_expand_from_the_environment(monkeypatch):
    monkeypatch.setenv("CXRDR_T_DATA", "/data")
    assert expand_env({"s": ["nih-bbox:${CXRDR_T_DATA:-../x}/n.jsonl", 3]}) == {"s": ["nih-bbox:/data/n.jsonl", 3]}
    monkeypatch.delenv("CXRDR_T_DATA")
    assert expand_env("${CXRDR_T_DATA:-../x}") == "../x"
    with pytest.raises(ValueError, match="CXRDR_T_DATA"):
        expand_env("${CXRDR_T_DATA}")


def test_real_nih_box_subset(shared_data):
    source = open_source(f"nih-bbox:{shared_data / 'nih_bbox' / 'nih_bbox.jsonl'}")
    recs = list(source)
    assert source.counts["by_split"] == {"train": 562, "val": 76, "test": 62}
    assert sum(len(r.boxes) for r in recs) == 780 and not {b["label"] for r in recs for b in r.boxes} - {
        "Atelectasis", "Cardiomegaly", "Effusion", "Infiltrate", "Mass", "Nodule", "Pneumonia", "Pneumothorax"}
