"""Issue 39 part 3: what retrieved captions buy (configs/experiments/image-only.yaml) and its CPU-size twin.

The twin (the same keys, tiny sizes) runs end to end: three builds of one phantom draw with 80 % of the
train studies' reports hidden (dropped, image-only for a retrieval captioner on a ckpt: teacher trained
first, label-composed), the four arms, the judgement and the retrieval grounding.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "experiments" / "image-only.yaml"
TWIN = ROOT / "configs" / "experiments" / "image-only-twin.yaml"
ARMS = ("plain-paired", "reinforced-retrieved", "reinforced-labels", "plain-all-reports")


def _leaves(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = "teachers.models.*" if prefix == "teachers.models" else f"{prefix}.{k}" if prefix else str(k)
            yield from _leaves(v, key)
    else:
        yield prefix, obj


def test_hidden_reports_are_the_same_train_studies_in_every_mode():
    from cxrdr.reinforce.sources import open_source

    sets = {}
    for mode in ("image-only", "labels", "drop"):
        source = open_source("phantom:60", seed=0, size=32, hide_reports=0.8, hidden=mode)
        source.allow_image_only = True
        sets[mode] = {r.id: r for r in source}
    full = {r.id: r for r in open_source("phantom:60", seed=0, size=32)}
    hidden = {i for i, r in sets["image-only"].items() if not r.report}
    assert hidden and all(full[i].split == "train" for i in hidden)
    assert 0.6 < len(hidden) / sum(r.split == "train" for r in full.values()) < 0.95
    assert set(sets["drop"]) == set(full) - hidden
    assert all(sets["image-only"][i].labels == {} and sets["image-only"][i].extra["text_source"] == "retrieved"
               for i in hidden)
    assert all(sets["labels"][i].extra["text_source"] == "labels" and sets["labels"][i].labels == full[i].labels
               for i in hidden)
    assert all(sets["labels"][i].report == full[i].report for i in set(full) - hidden)


def test_the_recipe_has_the_issues_arms_and_the_twin_its_keys():
    from cxrdr.experiments.recipe_file import load_recipe

    recipe = load_recipe(RECIPE)
    spec = recipe["efficiency"]
    assert list(spec["runs"]) == list(ARMS) and spec["curve_split"] == "report"
    assert recipe["selection"]["split"] == "val" and recipe["report"]["split"] == "test"
    for arm in ("plain-paired", "reinforced-retrieved", "plain-all-reports"):
        assert len(spec["runs"][arm]["seeds"]) >= 5 and min(spec["runs"][arm]["seeds"]) >= 10
    hidden = {a: spec["runs"][a]["shards"]["build"]["source_options"] for a in ARMS[:3]}
    assert {o["hidden"] for o in hidden.values()} == {"drop", "image-only", "labels"}
    assert {o["hide_reports"] for o in hidden.values()} == {0.8}
    retrieved = spec["runs"]["reinforced-retrieved"]["shards"]["build"]
    assert retrieved["captioner"] == "retrieval:train" and retrieved["teachers"].startswith("ckpt:")
    assert spec["judge"]["ceiling_fraction"] == 0.9 and spec["judge"]["sd_multiple"] == 2
    real, twin = (dict(_leaves(yaml.safe_load(p.read_text()))) for p in (RECIPE, TWIN))
    assert set(real) == set(twin)


def test_the_twin_runs_end_to_end(tmp_path, monkeypatch, one_thread):
    from typer.testing import CliRunner

    from cxrdr.cli import train_app as app

    monkeypatch.chdir(tmp_path)  # the twin's paths are relative: they land here
    recipe = yaml.safe_load(TWIN.read_text())
    result = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(TWIN), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = json.loads((Path(recipe["out"]) / "efficiency" / "results.json").read_text())
    assert set(out["arms"]) == set(ARMS)
    image_only = out["image_only"]
    assert [b["met"] is not None or b["value"] is not None for b in image_only["bars"]] == [True, True]
    for arm in ARMS:
        figures = image_only["figures"][arm]
        assert figures["mean_recall"]["mean"] is not None and "train_prior_pointing_z" in figures
    # the bank: the paired train reports only; the grounding read the true labels of the hidden studies
    info = json.loads(Path(recipe["efficiency"]["runs"]["reinforced-retrieved"]["shards"]["dir"],
                           "dataset.json").read_text())
    bank = info["captioner"]["bank"]
    hide = info["source"]["hide_reports"]
    assert bank["left_out_composed"] == hide["hidden_records"] > 0 and bank["reports"] < hide["paired_records"]
    grounding = image_only["grounding"]["reinforced-retrieved"]["train"]
    assert grounding["asserting_a_finding"] > 0 and 0 <= grounding["hit_rate"] <= 1
    assert set(image_only["grounding"]) == {"reinforced-retrieved"}
    assert "## Image-only" in (Path(recipe["out"]) / "efficiency" / "table.md").read_text()


def test_the_nih_variant_differs_from_the_nih_recipe_only_in_its_captions():
    """Issue 39 part 4 (configs/experiments/nih-retrieved.yaml): nih.yaml's teacher, students and settings;
    the retrieved arm's shards are the recipe's build but for the build teacher (the NIH-trained one, which
    the captioner needs) and IU train-report captions; fresh seeds."""
    from cxrdr.experiments.recipe_file import load_recipe

    configs = ROOT / "configs" / "experiments"
    nih, variant = load_recipe(configs / "nih.yaml"), load_recipe(configs / "nih-retrieved.yaml")

    def same_paths(block):
        return json.loads(json.dumps(block).replace("runs/experiments/nih-retrieved/", "runs/experiments/nih/"))

    assert same_paths(variant["teachers"]) == nih["teachers"]
    assert variant["train"] == nih["train"]
    assert same_paths(variant["shards"]) == nih["shards"]
    spec = variant["efficiency"]
    assert list(spec["runs"]) == ["reinforced-labels", "reinforced-retrieved"]
    assert spec["train"] == nih["efficiency"]["train"] and spec["final_metric"] == nih["efficiency"]["final_metric"]
    assert not set(spec["seeds"]) & set(nih["efficiency"]["seeds"])
    labels, retrieved = spec["runs"]["reinforced-labels"], spec["runs"]["reinforced-retrieved"]
    assert labels == nih["efficiency"]["runs"]["reinforced"] and "shards" not in labels
    build = dict(retrieved["shards"]["build"])
    assert build.pop("captioner").startswith("retrieval:") and build.pop("teachers") == \
        "ckpt:runs/experiments/nih-retrieved/teachers/lite2-nih.pt"
    assert build["source"].endswith("nih_bbox/nih_bbox.jsonl")
    assert {k: v for k, v in nih["shards"]["build"].items() if k != "teachers"} == build
    assert {k: v for k, v in retrieved.items() if k != "shards"} == labels
