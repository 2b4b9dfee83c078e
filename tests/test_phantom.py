"""Phantom generator: determinism, well-formed records, patient-disjoint splits, learnable signal."""
from __future__ import annotations

import functools
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from cxrdr.reinforce.phantom import (PhantomSource, cli_phantom, phantom_record, record_row, render_phantom,
                               write_phantom_dataset)
from cxrdr.reinforce.phantom.cases import DEVICE, SEVERITIES
from cxrdr.reinforce.phantom.report import (NEG_BONES, NEG_BOTH, NEG_CLEAR, NEG_CONSOLIDATION, NEG_EDEMA,
                                      NEG_EFFUSION, NEG_HEART, NEG_PNEUMOTHORAX)
from cxrdr.common.labels import CHEXPERT14
from cxrdr.reinforce.records import Record

# What the report must say when a label is positive (lower-case substrings, any of them).
MENTIONS = {"Cardiomegaly": ("cardiomegaly", "enlarge"), "Pleural Effusion": ("effusion",),
            "Pneumothorax": ("pneumothorax",), "Lung Lesion": ("nodul", "mass"),
            "Consolidation": ("consolidation",), "Lung Opacity": ("opacity",),
            "Atelectasis": ("atelectasis",), "Edema": ("edema",),
            "Support Devices": ("tube", "catheter", "line", "leads")}
NEGATIONS = {"Cardiomegaly": [t for t, _ in NEG_HEART], "Pleural Effusion": list(NEG_EFFUSION + NEG_BOTH),
             "Pneumothorax": list(NEG_PNEUMOTHORAX + NEG_BOTH), "Lung Opacity": list(NEG_CLEAR),
             "Consolidation": list(NEG_CONSOLIDATION), "Edema": list(NEG_EDEMA), "Fracture": list(NEG_BONES),
             "Enlarged Cardiomediastinum": ["The cardiomediastinal silhouette is normal."]}
KIND_LABEL = {"cardiomegaly": "Cardiomegaly", "pleural_effusion": "Pleural Effusion",
              "pneumothorax": "Pneumothorax", "nodule": "Lung Lesion", "mass": "Lung Lesion",
              "consolidation": "Consolidation", "lung_opacity": "Lung Opacity", "atelectasis": "Atelectasis",
              "edema": "Edema", DEVICE: "Support Devices"}


@pytest.fixture(scope="module")
def records() -> list[Record]:
    return list(PhantomSource(400, seed=1, size=128))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_identical_files_via_cli(tmp_path):
    app = typer.Typer()
    app.command()(cli_phantom)
    runner = CliRunner()
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        result = runner.invoke(app, ["--n", "10", "--out", str(tmp_path / name), "--seed", str(seed),
                                     "--size", "64"])
        assert result.exit_code == 0, result.output
    a, b, c = (_files(tmp_path / name) for name in "abc")
    assert len(a) == 11 and "records.jsonl" in a
    assert a == b
    assert a["records.jsonl"] != c["records.jsonl"]
    assert any(a[k] != c.get(k) for k in a if k.endswith(".png"))
    # rendered on threads, in order: each image is the one rendered alone, one at a time
    from cxrdr.reinforce.phantom.source import PhantomSource, _png, _rendered

    serial = [(r.id, _png(r)) for r in PhantomSource(10, seed=3, size=64)]
    assert [(r.id, png) for r, png in _rendered(PhantomSource(10, seed=3, size=64), threads=3)] == serial
    assert all(a[f"images/{key}.png"] == png for key, png in serial)


def test_written_rows_match_records(tmp_path):
    jsonl = write_phantom_dataset(6, tmp_path, seed=2, size=64, progress=False)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    recs = list(PhantomSource(6, seed=2, size=64))
    for row, rec in zip(rows, recs):
        assert set(row) == {"id", "subject_id", "study_id", "split", "view", "report", "findings",
                            "impression", "labels", "triples", "boxes", "image", "extra"}
        assert row["image"] == f"images/{rec.id}.png" and (tmp_path / row["image"]).is_file()
        assert row["labels"] == rec.labels and row["triples"] == [list(t) for t in rec.triples]
        from PIL import Image
        with Image.open(tmp_path / row["image"]) as img:
            assert img.mode == "L" and img.size == (64, 64)
            assert np.array_equal(np.asarray(img), np.asarray(rec.image()))


def test_a_phantom_set_killed_midway_leaves_no_records_and_a_rerun_writes_the_whole_set(tmp_path, monkeypatch):
    """records.jsonl appears once every image is written: the first rows of a killed command's would read as a
    whole, smaller set. An earlier set's records go before its images are written over."""
    from cxrdr.reinforce.phantom import source

    class Killed(BaseException):
        pass

    write_phantom_dataset(4, tmp_path, seed=5, size=64, progress=False)  # an earlier set in the folder
    real_png, made = source._png, []

    def dies_at_the_fourth(record):
        made.append(record.id)
        if len(made) == 4:
            raise Killed()
        return real_png(record)

    with monkeypatch.context() as patch:
        patch.setattr(source, "_png", dies_at_the_fourth)
        with pytest.raises(Killed):
            write_phantom_dataset(6, tmp_path, seed=2, size=64, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images"]  # no records, no temp file
    jsonl = write_phantom_dataset(6, tmp_path, seed=2, size=64, progress=False)
    assert jsonl.read_bytes() == write_phantom_dataset(6, tmp_path / "whole", seed=2, size=64,
                                                       progress=False).read_bytes()


def test_evaluation_phantom_and_several_seeds():
    one, other = list(PhantomSource(30, seed=0)), list(PhantomSource(30, seed=1))
    both = list(PhantomSource(30, seed=[0, 1]))
    assert len(both) == 60 and [r.report for r in both] == [r.report for r in one + other]
    assert [r.id for r in both[:30]] == [r.id for r in one]  # the first seed keeps its ids
    assert [r.id for r in both[30:]] == ["s1-" + r.id for r in other]  # later seeds are told apart
    assert [r.split for r in both] == [r.split for r in one + other]  # each seed keeps its own split
    assert len({r.id for r in both}) == 60
    held_out = list(PhantomSource(30, seed=7, split="test"))
    assert {r.split for r in held_out} == {"test"}
    assert PhantomSource(3, seed=7, split="test").describe()["split"] == "test"
    with pytest.raises(ValueError, match="split"):
        PhantomSource(3, split="holdout")
    with pytest.raises(ValueError, match="distinct"):
        PhantomSource(3, seed=[1, 1])


def test_records_are_lazy_and_prefix_stable():
    small, large = list(PhantomSource(20, seed=5)), list(PhantomSource(40, seed=5))
    assert [r.report for r in small] == [r.report for r in large[:20]]
    rec = small[7]
    assert isinstance(rec.image, functools.partial) and rec.image.func is render_phantom
    assert rec.image.args == (5, 7, 256)
    source = PhantomSource(3)
    assert source.requires_images and len(source.skipped) == 0 and source.name == "phantom:3"
    json.dumps(source.describe())
    with pytest.raises(ValueError):
        PhantomSource(-1)


def test_records_well_formed(records):
    ids = [r.id for r in records]
    assert len(set(ids)) == len(ids)
    n_normal = 0
    for rec in records:
        kinds = [f["kind"] for f in rec.extra["phantom"]["findings"]]
        assert len(kinds) <= 3
        assert set(rec.labels) == set(CHEXPERT14)
        assert rec.report == f"{rec.findings} {rec.impression}".strip()
        text = rec.report.lower()
        # Boxes: one per finding (one per lung when bilateral), inside the image, labelled with the finding.
        findings = rec.extra["phantom"]["findings"]
        expected = [f["kind"] for f in findings for _ in range(2 if f["side"] == "bilateral" else 1)]
        assert [b["label"] for b in rec.boxes] == expected
        for b in rec.boxes:
            x0, y0, x1, y1 = b["box"]
            assert 0 <= x0 < x1 <= 128 and 0 <= y0 < y1 <= 128, (rec.id, b)
            assert b.get("side", "") in ("right", "left", "")
        for f in findings:
            if f["side"] == "bilateral":  # split at the midline: the patient's right lung is on the image left
                right, left = [b for b in rec.boxes if b["label"] == f["kind"]]
                assert (right["side"], left["side"]) == ("right", "left")
                assert right["box"][2] <= left["box"][0] + 1.0, (rec.id, right, left)
        # Labels <-> findings <-> triples <-> report.
        positives = {name for name, v in rec.labels.items() if v == 1 and name != "No Finding"}
        assert positives == {KIND_LABEL[k] for k in kinds}, rec.id
        assert {s for s, _, _ in rec.triples} == set(kinds)
        for s, p, o in rec.triples:
            assert p in ("HAS_LOCATION", "HAS_SEVERITY", "IS_A", "ASSOCIATED_WITH")
            if p == "HAS_SEVERITY":
                assert o in SEVERITIES[s] and o in text
            if p == "ASSOCIATED_WITH":
                assert o in kinds
        for name in positives:
            assert any(m in text for m in MENTIONS[name]), (rec.id, name, rec.report)
        for name, value in rec.labels.items():
            if value == 0 and name != "No Finding":
                assert any(neg in rec.report for neg in NEGATIONS[name]), (rec.id, name, rec.report)
        # Key findings are always either described or explicitly negated.
        for name in ("Cardiomegaly", "Pleural Effusion", "Pneumothorax"):
            assert rec.labels[name] in (0, 1), (rec.id, name)
        pathologies = [k for k in kinds if k != DEVICE]
        assert rec.labels["No Finding"] == (0 if pathologies else 1)
        n_normal += not pathologies
    assert 0.2 < n_normal / len(records) < 0.4
    # Phrasing varies: many distinct sentences for the same finding.
    effusion_sentences = {s for r in records for s in re.split(r"(?<=\.) ", r.findings) if "effusion" in s
                          and not s.startswith(("No ", "There is no", "No evidence"))}
    assert len(effusion_sentences) >= 8


def test_splits_are_patient_disjoint(records):
    by_subject: dict[str, set] = defaultdict(set)
    studies: dict[str, list] = defaultdict(list)
    for rec in records:
        assert re.fullmatch(r"ph-s\d{5}-st[1-4]", rec.id) and rec.id.startswith(rec.subject_id)
        by_subject[rec.subject_id].add(rec.split)
        studies[rec.subject_id].append(rec.id)
        assert rec.view in ("PA", "AP")
    assert all(len(splits) == 1 for splits in by_subject.values())
    assert {s for splits in by_subject.values() for s in splits} == {"train", "val", "test"}
    counts = [len(v) for v in studies.values()]
    assert max(counts) <= 4 and min(counts) >= 1 and max(counts) > 1
    # Same subject, same habitus: the normal heart size is shared across studies.
    ctrs = defaultdict(set)
    for rec in records:
        if rec.labels["Cardiomegaly"] != 1:
            ctrs[rec.subject_id].add(rec.extra["phantom"]["ctr"])
    assert all(len(v) == 1 for v in ctrs.values())


def test_render_is_deterministic_grayscale():
    a, b = render_phantom(0, 3, 96), render_phantom(0, 3, 96)
    assert a.mode == "L" and a.size == (96, 96) and a.tobytes() == b.tobytes()
    assert render_phantom(1, 3, 96).tobytes() != a.tobytes()
    row = record_row(phantom_record(0, 3, 96), "images/x.png")
    json.dumps(row)


def test_row_and_column_grids_render_the_pixels_and_boxes_of_full_grids(monkeypatch):
    """The render draws on a (1, N) row and an (N, 1) column that numpy broadcasts; on full N x N
    grids (as it once drew) every pixel and box is the same, for every kind of finding."""
    from cxrdr.reinforce.phantom import render
    from cxrdr.reinforce.phantom.source import sample_case

    kinds = set(SEVERITIES) | {DEVICE}
    cases, seen = [], set()
    for index in range(400):  # a normal study, then one more for each kind not yet drawn
        case = sample_case(0, index)
        kinds_here = {f.kind for f in case.findings}
        if (kinds_here - seen) or (not kinds_here and "normal" not in seen):
            cases.append(case)
            seen |= kinds_here or {"normal"}
    assert kinds | {"normal"} <= seen, f"the first 400 phantom cases lack {kinds - seen}"

    def draw(cases):
        return [(render.render_case(c, size).tobytes(), render.finding_boxes(c, size))
                for c in cases for size in (64, 100)]

    broadcast = draw(cases)
    assert render._grid(64)[0].shape == (1, 64) and render._grid(64)[1].shape == (64, 1)

    row_and_column = render._grid

    def full_grid(size):  # the same pixel centres, spelled out over every pixel
        X, Y = row_and_column(size)
        return tuple(np.meshgrid(X.ravel(), Y.ravel()))

    monkeypatch.setattr(render, "_grid", full_grid)
    assert draw(cases) == broadcast


def test_findings_are_learnable_by_a_tiny_cnn():
    """A tiny CNN trained for a few hundred CPU steps separates cardiomegaly and effusion."""
    import torch

    targets = ("Cardiomegaly", "Pleural Effusion")
    recs = list(PhantomSource(600, seed=11, size=64))
    x = np.stack([np.asarray(r.image(), dtype=np.float32) for r in recs])[:, None] / 255.0
    x = (x - x.mean(axis=(2, 3), keepdims=True)) / (x.std(axis=(2, 3), keepdims=True) + 1e-6)
    y = np.array([[float(r.labels[t] == 1) for t in targets] for r in recs], dtype=np.float32)
    train = np.array([r.split == "train" for r in recs])
    xtr, ytr = torch.from_numpy(x[train]), torch.from_numpy(y[train])
    xte, yte = torch.from_numpy(x[~train]), y[~train]
    assert len(xte) >= 60 and yte.sum(axis=0).min() >= 5

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convs: one thread is faster than two contended ones
    try:
        aucs = _train_and_score(torch, xtr, ytr, xte, yte, targets)
    finally:
        torch.set_num_threads(threads)
    print("held-out AUC", aucs)
    assert all(auc > 0.75 for auc in aucs.values()), aucs


def _train_and_score(torch, xtr, ytr, xte, yte, targets) -> dict[str, float]:
    from sklearn.metrics import roc_auc_score

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, len(targets)))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(250):
        idx = torch.randint(len(xtr), (32,), generator=gen)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        scores = model(xte).numpy()
    return {t: float(roc_auc_score(yte[:, i], scores[:, i])) for i, t in enumerate(targets)}
