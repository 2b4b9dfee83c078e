"""Issue 37 part 6: the NIH recipe, shrunk, run twice from empty folders gives the same results to the digit.

The twin keeps configs/experiments/nih.yaml's structure (nih-bbox source, placeholder build teacher, its own
teacher build and training, add-teacher, plain and reinforced arms with validation curves, the box
benchmark, the step benchmark with the online teacher) on a generated nih_bbox folder, with tiny models and
a few steps. Only the measured fields (cxrdr/experiments/repro.py: timings and memory) may differ.
Both runs share this process (two processes would cost ~8 s more): that two commands with different
PYTHONHASHSEEDs agree too was checked by hand (docs/real-radiographs.md, "Reproducing the NIH figures").
"""
from __future__ import annotations

import json

import numpy as np
import yaml
from PIL import Image

from cxrdr.experiments.repro import MEASURED_KEYS, comparable, differences

from tests.conftest import REPO

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax"]


def _nih_folder(root, n=16):
    """A generated nih_bbox folder (the shared one's layout): noise images with one bright boxed block."""
    folder = root / "nih_bbox"
    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        labels = sorted({FINDINGS[i % 8], FINDINGS[(3 * i) % 8]})
        image = (rng.random((64, 64)) * 120 + 40).astype(np.uint8)
        x = 4 + (7 * i) % 40
        image[10:30, x:x + 16] = 220
        Image.fromarray(image).save(folder / "images" / f"{i}.png")
        rows.append({"image": f"images/{i}.png", "id": str(i), "subject_id": f"nih-{i}", "study_id": f"s{i}",
                     "split": "train" if i < n // 2 else ("val" if i < 3 * n // 4 else "test"),
                     "view": "frontal", "labels": labels,
                     "boxes": [{"label": labels[0].replace("Infiltration", "Infiltrate"), "box": [x, 10, x + 16, 30]}]})
    (folder / "nih_bbox.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _tiny_twin(path):
    """configs/experiments/nih.yaml with tiny models, views and steps; every key and stage kept."""
    recipe = yaml.safe_load((REPO / "configs" / "experiments" / "nih.yaml").read_text())
    for part in ("shards", "teachers"):
        recipe[part]["build"].update(n_aug=2, n_captions=2, store_size=64, batch_size=16)
    recipe["teachers"]["train"].update(model="tiny-A", steps=2, batch_size=8, log_every=1)
    # eval_prompts stays `configs/prompts-nih.yaml`: read from the shipped configs in an empty folder
    recipe["train"].update(model="tiny-D", steps=3, batch_size=8, log_every=1, eval_batch_size=16, progress=False)
    # the cost block (efficiency: a process of its own) holds only measured fields: not computed here
    recipe["eval"].update(min_positives=1, probe_max_train=16, n_localisation=2, n_faithfulness=1, faith_steps=2,
                          n_plots=0, efficiency=False)
    recipe["efficiency"].update(seeds=[0], eval_every_samples=12, step_benchmark={"steps": 1, "warmup": 0})
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _run(folder, config, monkeypatch):
    """The recipe from an empty folder (its relative paths, runs/experiments/nih/..., land there)."""
    from typer.testing import CliRunner

    from cxrdr.cli import train_app

    folder.mkdir()
    monkeypatch.chdir(folder)
    result = CliRunner().invoke(train_app, ["experiment", "efficiency", "--config", str(config), "--quiet"])
    assert result.exit_code == 0, result.output[-3000:] + repr(result.exception)
    return json.loads((folder / "runs" / "experiments" / "nih" / "efficiency" / "results.json").read_text())


def test_the_nih_recipe_twice_from_empty_folders_gives_the_same_results(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("CXRDR_SHARED_DATA", str(_nih_folder(tmp_path / "data")))
    config = _tiny_twin(tmp_path / "nih-twin.yaml")
    first = _run(tmp_path / "a", config, monkeypatch)
    second = _run(tmp_path / "b", config, monkeypatch)
    assert differences(comparable(first), comparable(second)) == []
    # what is compared holds the results, to the digit
    kept = comparable(first)
    for arm in ("plain", "reinforced"):
        run = kept["runs"][arm][0]
        assert isinstance(run["final"]["zero_shot_auc_mean"], float) and len(run["curve"]) >= 2
        assert isinstance(run["train_summary"]["last_loss"], float)
    assert kept["teachers"]["lite2-nih"]["own_test"]["mean_recall"] is not None
    assert kept["code"] == kept["runs"]["plain"][0]["train_summary"]["code"] == kept["teachers"]["lite2-nih"]["code"]
    assert kept["runs"]["plain"][0]["train_summary"]["torch_threads"] == 1  # the recipe's `threads`
    assert kept["runs"]["plain"][0]["train_config"]["eval_prompts"].endswith("prompts-nih.yaml")
    # and only measured fields were left out: each appears in the full results
    text = json.dumps(first)
    assert {"wall_s", "mean_step_ms", "bench_step_ms", "add_teacher_s"} <= {k for k in MEASURED_KEYS
                                                                            if f'"{k}"' in text}


def test_only_the_measured_fields_are_left_out_of_the_comparison():
    result = {"wall_s": 3.2, "final": {"zero_shot_auc_mean": 0.5159, "latency_ms": 4.0, "peak_memory_mb": 900.0},
              "table": [{"step_ms": 549.0, "step_ms_seeds": [549.0], "mean_recall_seeds": [0.1]}],
              "bars": [{"bar": "stored step <= 1.05x no-teacher step", "value": 1.01, "met": True},
                       {"bar": "reinforced final mean R - plain's > 2 sd", "value": 0.03, "met": False}]}
    assert comparable(result) == {"final": {"zero_shot_auc_mean": 0.5159},
                                  "table": [{"mean_recall_seeds": [0.1]}],
                                  "bars": [{"bar": "stored step <= 1.05x no-teacher step"},
                                           {"bar": "reinforced final mean R - plain's > 2 sd", "value": 0.03,
                                            "met": False}]}
    assert differences({"pointing_z": float("nan")}, {"pointing_z": float("nan")}) == []
    other = json.loads(json.dumps(result))
    other["final"]["zero_shot_auc_mean"] = 0.5158877807736046
    assert differences(comparable(result), comparable(other)) == [
        "/final/zero_shot_auc_mean: 0.5159 != 0.5158877807736046"]
