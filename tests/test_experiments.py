"""`train experiment efficiency` end to end with a micro recipe (few steps, tiny phantom shards)."""
from __future__ import annotations

import json

import pytest
import yaml


@pytest.fixture()
def micro_recipe(tmp_path):
    recipe = {
        "name": "micro",
        "out": str(tmp_path / "out"),
        "device": "cpu",
        "shards": {"dir": str(tmp_path / "shards"),
                   "build": {"source": "phantom:40", "teachers": "random:tiny", "n_aug": 2, "n_captions": 2,
                             "store_size": 64, "image_format": "png", "shard_size": 100, "workers": 0,
                             "batch_size": 16, "device": "cpu", "source_options": {"size": 64}}},
        "train": {"model": "tiny-D", "steps": 2, "batch_size": 8, "workers": 0, "progress": False,
                  "log_every": 1},
        "eval": {"min_positives": 2, "n_faithfulness": 1, "faith_steps": 2, "n_localisation": 4,
                 "probe_max_train": 16, "efficiency": False, "n_plots": 2},
        "isolated_efficiency": False,
        "efficiency": {"eval_every_samples": 8, "step_benchmark": {"steps": 2, "warmup": 1},
                       "runs": {"plain": {"mode": "plain"}, "reinforced": {"mode": "reinforced"},
                                "online": {"mode": "reinforced", "online_teacher": "random:tiny"}}},
    }
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, tmp_path


def test_efficiency_experiment_writes_tables_and_plots(micro_recipe):
    from typer.testing import CliRunner

    from train.cli import app

    path, root = micro_recipe
    result = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(path), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = root / "out" / "efficiency"
    for name in ("results.json", "table.md", "metric_vs_samples.png", "auc_vs_samples.png", "step_time.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in data["table"]] == ["plain", "reinforced", "online"]
    samples = {r["run"]: r["samples_seen"] for r in data["table"]}
    assert len(set(samples.values())) == 1  # same samples seen
    assert len(data["runs"]["plain"]["curve"]) >= 2  # evaluated every M samples (and at the end)
    assert "step_ms_reinforced_over_online" in data["comparisons"]
    assert "bench_step_ms_reinforced_over_online" in data["comparisons"]
    table = (out / "table.md").read_text()
    assert "| run |" in table and "loop step ms" in table
    assert (root / "shards" / "dataset.json").is_file()  # built because it was missing


def test_recipe_errors_are_one_line(tmp_path):
    from train.experiments import load_recipe

    bad = tmp_path / "bad.yaml"
    bad.write_text("shards: {dir: x}\nbogus: 1\n")
    with pytest.raises(ValueError, match="unknown experiment key"):
        load_recipe(bad)
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")


def test_ablation_over_seeds_reports_mean_sd_and_chance_and_reuses_runs(micro_recipe):
    from typer.testing import CliRunner

    from train.cli import app

    path, root = micro_recipe
    recipe = yaml.safe_load(path.read_text())
    recipe["ablation"] = {"seeds": [0, 1], "variants": {"A": "tiny-A", "E": "tiny-E"}}
    recipe["train"]["steps"] = 1
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(app, ["experiment", "ablation", "--config", str(path), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = root / "out" / "ablation"
    data = json.loads((out / "results.json").read_text())
    assert data["seeds"] == [0, 1] and [r["run"] for r in data["table"]] == ["A", "E"]
    for row in data["table"]:
        assert row["n_seeds"] == 2 and len(row["mean_recall_seeds"]) == 2
        assert row["mean_recall"] == pytest.approx(sum(row["mean_recall_seeds"]) / 2)
        assert row["mean_recall_sd"] is not None and 0 < row["chance_mean_recall"] < 1
        assert row["mean_recall_x_chance"] == pytest.approx(row["mean_recall"] / row["chance_mean_recall"])
    runs = [r["seed"] for r in data["runs"]["E"]["seeds"]]
    assert runs == [0, 1] and (out / "runs" / "variant-E" / "seed-1" / "last.pt").is_file()
    table = (out / "table.md").read_text()
    assert " ± " in table and "mean R chance" in table and "PG z chance" in table
    # a second invocation reuses the finished runs and their evaluations
    eval_json = out / "runs" / "variant-A" / "seed-0" / "eval-test" / "eval.json"
    stamp = eval_json.stat().st_mtime
    again = CliRunner().invoke(app, ["experiment", "ablation", "--config", str(path), "--quiet"])
    assert again.exit_code == 0, again.output
    assert eval_json.stat().st_mtime == stamp
    assert json.loads((out / "results.json").read_text())["table"][0]["mean_recall"] == data["table"][0]["mean_recall"]
