"""`train experiment efficiency` end to end with a micro recipe (few steps, tiny phantom shards)."""
from __future__ import annotations

import json

import numpy as np
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
        "efficiency": {"eval_every_samples": 8, "step_benchmark": {"steps": 1, "warmup": 0},
                       "runs": {"plain": {"mode": "plain"}, "reinforced": {"mode": "reinforced"},
                                "online": {"mode": "reinforced", "online_teacher": "random:tiny"}}},
    }
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, tmp_path


def _with_teacher_and_seeds(path, root):
    """The micro recipe with 2 seeds and a micro image-text teacher trained on its own phantom set."""
    recipe = yaml.safe_load(path.read_text())
    build = dict(recipe["shards"]["build"])
    recipe["teachers"] = {"dir": str(root / "teachers"), "build": build,
                          "train": {"model": "tiny-A", "steps": 1, "batch_size": 8, "workers": 0,
                                    "progress": False, "log_every": 1},
                          "models": {"t1": {"source_seed": 1}}}
    recipe["efficiency"]["seeds"] = [0, 1]
    recipe["efficiency"]["train"] = {"teachers": "ckpt-t1"}
    recipe["efficiency"]["runs"]["online"]["online_teacher"] = f"ckpt:{root / 'teachers' / 't1.pt'}"
    recipe["efficiency"]["runs"]["online"]["seeds"] = [0]  # a run may name its own seeds
    recipe["efficiency"]["comparisons"] = [["reinforced", "plain"]]  # read against another arm as against plain
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def test_efficiency_experiment_over_seeds_with_trained_teacher(micro_recipe):
    from typer.testing import CliRunner

    from cxrdr.cli import train_app as app

    path, root = micro_recipe
    _with_teacher_and_seeds(path, root)
    result = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(path), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = root / "out" / "efficiency"
    for name in ("results.json", "table.md", "metric_vs_samples.png", "auc_vs_samples.png", "step_time.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "results.json").read_text())
    assert data["seeds"] == [0, 1] and [r["run"] for r in data["table"]] == ["plain", "reinforced", "online"]
    for arm, seeds in (("plain", [0, 1]), ("reinforced", [0, 1]), ("online", [0])):
        finals = data["arms"][arm]["final_mean_recall"]
        assert len(finals) == len(seeds) and all(0 <= v <= 1 for v in finals)
        reach = data["arms"][arm]["samples_to_plain_final"]
        assert reach is None or reach > 0
        assert [r["seed"] for r in data["runs"][arm]] == seeds
        assert len(data["runs"][arm][0]["curve"]) >= 2  # evaluated every M samples (and at the end)
    assert len({r["samples_seen"] for r in data["table"]}) == 1  # same samples seen
    plain = data["table"][0]
    assert plain["mean_recall_ci"] is not None and 0 < plain["chance_mean_recall"] < 1
    # the teacher: trained on its own seed's phantom set, added to the students' shards, judged on both tests
    teacher = data["teachers"]["t1"]
    assert teacher["shard_name"] == "ckpt-t1" and teacher["source_seed"] == 1
    assert "mean_recall" in teacher["own_test"] and "mean_recall" in teacher["student_test"]
    # its own phantom draw: none of its training images is a student's, and the accounting says so
    assert teacher["train_images_shared"] == 0 and data["cost"]["teacher_train_images_shared"] == 0
    info = json.loads((root / "shards" / "dataset.json").read_text())
    assert "ckpt-t1" in {t["name"] for t in info["teachers"]}
    assert data["cost"]["teachers"] == ["ckpt-t1"] and data["cost"]["add_teacher_s"] > 0
    assert data["cost"]["build_teacher_s"] == 0  # random:tiny of the build is not what the students read
    assert {b["bar"] for b in data["bars"]} >= {"online step >= 3x stored step"}
    table = (out / "table.md").read_text()
    assert " ± " in table and "mean R chance" in table and "break-even:" in table
    assert "training runs" in table and ("MET" in table or "MISSED" in table)
    assert "of images the students never see" in table
    # the samples ratio at three targets, the teacher's compute, the runs' own step ratio, the comparison
    assert data["target_fractions"] == [1.0, 0.95, 0.9]
    crossings = data["arms"]["reinforced"]["crossings"]
    assert [c.get("fraction", 1.0) for c in crossings] == [1.0, 0.95, 0.9]
    assert crossings[0] == data["arms"]["reinforced"]["crossing"]
    teacher_s = data["cost"]["teacher_compute_s"]
    assert teacher_s == pytest.approx(teacher["train_wall_s"] + data["cost"]["total_s"]) and teacher_s > 0
    assert data["step_ratio"]["reinforced"]["runs_ratio"] > 0 and data["step_ratio"]["reinforced"]["bench_ratio"] > 0
    (comparison,) = data["comparisons"]
    assert (comparison["arm"], comparison["against"], comparison["n_arm"]) == ("reinforced", "plain", 2)
    assert "Teacher compute:" in table and "by the runs' own mean steps" in table
    assert "Samples ratio at three targets" in table and "## reinforced against plain" in table
    # the pointing games against the train-box prior, paired and pooled over the arm's seeds
    _assert_pooled_margins(data["margins_over_train_prior"]["plain"], [r["final"] for r in data["runs"]["plain"]])
    assert "Pointing games − train-box prior" in table
    # a second invocation reuses the runs and measures the step benchmark afresh over its scratch folders
    result = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(path), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    again = json.loads((out / "results.json").read_text())
    assert again["arms"]["plain"]["final_mean_recall"] == data["arms"]["plain"]["final_mean_recall"]
    assert set(again["bench_step_ms"]) == {"plain", "reinforced", "online"}


def _assert_pooled_margins(margins: dict, finals: list[dict]) -> None:
    """Each figure's pooled margin is the seed mean of the runs' own PG − train prior, inside its intervals."""
    assert set(margins) == {"pointing_z", "pointing_z_pathology", "pointing_attn"}
    for figure, m in margins.items():
        assert m["n_seeds"] == len(finals) and len(m["per_seed"]) == len(finals) and m["n_images"] > 0
        per_seed = [f[figure] - f[f"train_prior_{figure}"] for f in finals]
        assert [s["margin"] for s in m["per_seed"]] == pytest.approx(per_seed), figure
        assert m["margin"] == pytest.approx(sum(per_seed) / len(per_seed))
        for interval in (m["interval"], m["interval_images"]):
            assert interval[0] <= m["margin"] + 1e-9 and m["margin"] - 1e-9 <= interval[1]


def test_reinforcement_ablation_trains_each_setting_once_per_seed(micro_recipe):
    from typer.testing import CliRunner

    from cxrdr.cli import train_app as app

    path, root = micro_recipe
    recipe = yaml.safe_load(path.read_text())
    recipe["train"]["steps"] = 1
    recipe["reinforcement"] = {"seeds": [0, 1], "train": {"mode": "reinforced"},
                               "studies": {"K": {"key": "aug_limit", "values": [1, 2]},
                                           "B_syn": {"key": "loss.use_syn", "values": [True, False]},
                                           "lambda": {"key": "loss.lambda_distill", "values": [0.0, 0.7]},
                                           "captions": {"key": "caption_sources", "values": [["report"]]}}}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(app, ["experiment", "reinforcement", "--config", str(path), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = root / "out" / "reinforcement"
    data = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in data["studies"]["K"]] == ["aug_limit=1", "aug_limit=2"]
    for rows in data["studies"].values():
        for row in rows:
            assert len(row["final_mean_recall"]) == 2 and row["mean_recall_sd"] is not None
    # 7 settings; use_syn on and lambda 0.7 both resolve to the base config: 6 distinct runs
    assert len(list((out / "runs").iterdir())) == 6
    assert data["studies"]["B_syn"][0]["mean_recall_seeds"] == data["studies"]["lambda"][1]["mean_recall_seeds"]
    saved = yaml.safe_load((next(p for p in (out / "runs").iterdir()
                                 if "report" in (p / "seed-0" / "config.yaml").read_text()) / "seed-0" /
                            "config.yaml").read_text())
    assert saved["caption_sources"] == ["report"] and saved["seed"] == 0
    table = (out / "table.md").read_text()
    assert "## K (`aug_limit`)" in table and " ± " in table and "mean R chance" in table


def test_caption_sources_and_aug_limit_restrict_what_training_reads(phantom_shards):
    from cxrdr.train.data import SampleView, make_loader

    loader = make_loader(phantom_shards, "train", None, 4, image_size=32, tokenize=None, aug_limit=1,
                         caption_sources=["report"])
    seen = set()
    for i, batch in zip(range(4), loader):
        seen.update(batch["aug_index"].tolist())
    assert seen == {0}  # only the first of the K stored views
    view = SampleView(split="train", image_size=32, caption_sources=("report",))
    captions = [{"text": "a", "source": "rdf"}, {"text": "b", "source": "report"},
                {"text": "c", "source": "normal"}, {"text": "d", "source": "report"}]
    rngs = [np.random.default_rng(i) for i in range(40)]
    picked = {view._caption(captions, "", rng)[0] for rng in rngs}
    assert picked == {1, 3}  # only report sentences, indexed into the stored rows
    rdf = SampleView(split="train", image_size=32, caption_sources=("rdf", "normal"))
    assert {rdf._caption(captions, "", rng)[0] for rng in rngs} == {0, 2}
    none = SampleView(split="train", image_size=32, caption_sources=("report",))
    assert none._caption(captions[:1], "the report", rngs[0])[0] == -1  # falls back to the report


def test_t_interval_matches_the_t_distribution():
    from scipy import stats

    from cxrdr.experiments.stats import t_interval

    values = [0.20, 0.25, 0.30]
    mean, half = t_interval(values)
    assert mean == pytest.approx(0.25)
    assert half == pytest.approx(stats.t.ppf(0.975, 2) * 0.05 / 3 ** 0.5)  # sd 0.05, n 3
    assert t_interval([0.4]) == (0.4, None)
    assert t_interval([]) == (None, None)


def test_samples_to_target_interpolates_the_first_crossing():
    from cxrdr.experiments.stats import samples_to_target

    xs, ys = [100, 200, 300, 400], [0.1, 0.2, 0.4, 0.3]
    assert samples_to_target(xs, ys, 0.3) == pytest.approx(250)  # halfway between 200 and 300
    assert samples_to_target(xs, ys, 0.2) == pytest.approx(200)
    assert samples_to_target(xs, ys, 0.05) == 100  # reached at the first evaluation: its x
    assert samples_to_target(xs, ys, 0.5) is None
    assert samples_to_target(xs, [None, 0.2, 0.4, 0.3], 0.3) == pytest.approx(250)


def test_break_even_and_bars():
    from cxrdr.experiments.efficiency import bars, break_even

    cost = break_even(120.0, online_ms=1000.0, stored_ms=200.0, steps=300)
    assert cost["saving_per_run_s"] == pytest.approx(240.0) and cost["break_even_runs"] == pytest.approx(0.5)
    assert break_even(120.0, 200.0, 200.0, 300)["break_even_runs"] is None  # nothing saved: never pays off
    crossing = {"ratio": 0.3, "ratio_ci": [0.25, 0.38], "samples": 1500, "plain_samples": 5000}
    arms = {"plain": {"final_mean_recall": [0.20, 0.22, 0.21]},
            "reinforced": {"final_mean_recall": [0.30, 0.31, 0.29], "samples_to_plain_final": 1500,
                           "crossing": crossing}}
    measured = bars(arms, {"plain": 100.0, "reinforced": 104.0, "online": 300.0}, 6000)
    got = {b["bar"].split(" (")[0]: b["met"] for b in measured}
    assert got == {"reinforced reaches plain's final mean R with <= 1/3 of plain's samples": True,
                   "(old definition, not judged) reinforced's first crossing / plain's whole budget": None,
                   "reinforced final mean R - plain's > 2 sd of plain's seeds": True,
                   "stored step <= 1.05x no-teacher step": True, "online step >= 3x stored step": False}
    assert measured[1]["value"] == pytest.approx(0.25)  # the old definition: 1500 / 6000
    arms["reinforced"]["crossing"] = dict(crossing, ratio_ci=[0.25, 0.45])  # the mean passes, its interval not
    assert bars(arms, {}, 6000)[0]["met"] is False

    # the GPU recipe's bars (issue 36): <= 1/4 with the upper bound <= 1/3, and pointing games over the prior
    arms["reinforced"]["crossing"] = dict(crossing, ratio=0.24, ratio_ci=[0.2, 0.33])
    margins = {"reinforced": {"pointing_z": {"margin": 0.2, "interval": [0.1, 0.3]},
                              "pointing_attn": {"margin": 0.1, "interval": [0.0, 0.2]}}}
    gpu = bars(arms, {}, 6000, fraction=0.25, upper=1 / 3,
               pointing={"arms": ["reinforced"], "over_train_prior": 0.15}, margins=margins)
    assert gpu[0]["met"] is True and "<= 1/4 of plain's samples" in gpu[0]["bar"] and "<= 0.333" in gpu[0]["bar"]
    assert bars(arms, {}, 6000, fraction=0.25)[0]["met"] is False  # the default upper bound, 0.30
    pointing = [b for b in gpu if "train-box prior" in b["bar"]]
    assert [(b["bar"].split()[1], b["value"], b["met"], b["ci"]) for b in pointing] == [
        ("pointing_z", 0.2, True, [0.1, 0.3]), ("pointing_attn", 0.1, False, [0.0, 0.2])]
    no_margins = bars(arms, {}, 6000, pointing={"arms": ["reinforced"], "over_train_prior": 0.15})
    assert [b["met"] for b in no_margins if "train-box prior" in b["bar"]] == [None, None]  # not measured: n/a


def test_crossing_ratio_reads_every_arm_by_its_first_crossing():
    from cxrdr.experiments.stats import crossing_ratio

    def curve(ys):
        return [{"samples_seen": 100 * (i + 1), "mean_recall": y} for i, y in enumerate(ys)]

    plain = [curve([0.1, 0.3, 0.4, 0.4]), curve([0.1, 0.3, 0.4, 0.4])]  # reaches its final 0.4 at 300
    fast = [curve([0.2, 0.4, 0.5, 0.5]), curve([0.2, 0.4, 0.5, 0.5])]  # reaches 0.4 at 200
    got = crossing_ratio(fast, plain, n_boot=50)
    assert got["target"] == pytest.approx(0.4) and got["samples"] == pytest.approx(200)
    assert got["plain_samples"] == pytest.approx(300) and got["ratio"] == pytest.approx(2 / 3)
    assert got["ratio_ci"] == pytest.approx([2 / 3, 2 / 3])  # identical seeds: no spread
    never = crossing_ratio([curve([0.1, 0.2, 0.2, 0.2])] * 2, plain, n_boot=20)
    assert never["ratio"] is None and never["ratio_ci"][1] == float("inf")


def test_crossing_ratio_at_a_fraction_of_the_reference_final():
    from cxrdr.experiments.stats import crossing_ratio

    def curve(ys):
        return [{"samples_seen": 100 * (i + 1), "mean_recall": y} for i, y in enumerate(ys)]

    plain = [curve([0.1, 0.3, 0.4, 0.4])] * 2
    fast = [curve([0.2, 0.4, 0.5, 0.5])] * 2
    assert crossing_ratio(fast, plain, n_boot=20, fraction=1.0) == crossing_ratio(fast, plain, n_boot=20)
    got = crossing_ratio(fast, plain, n_boot=20, fraction=0.9)  # target 0.36: plain at 260, fast at 180
    assert got["fraction"] == 0.9 and got["target"] == pytest.approx(0.36)
    assert got["plain_samples"] == pytest.approx(260) and got["samples"] == pytest.approx(180)
    assert got["ratio"] == pytest.approx(180 / 260) and got["ratio_ci"] == pytest.approx([180 / 260] * 2)


def test_gap_interval_is_welchs():
    from scipy import stats

    from cxrdr.experiments.stats import gap_interval

    a, b = [0.36, 0.33, 0.39, 0.35, 0.37], [0.30, 0.26, 0.35, 0.31, 0.28, 0.33, 0.29, 0.27]
    got = gap_interval(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert got["gap"] == pytest.approx(np.mean(a) - np.mean(b)) and got["gap_ci"] == pytest.approx([ci.low, ci.high])
    assert got["ref_sd"] == pytest.approx(np.std(b, ddof=1)) and (got["n_arm"], got["n_ref"]) == (5, 8)
    assert gap_interval([0.3], b)["gap_ci"] is None


def test_step_ratios_and_the_comparison_of_two_arms():
    from cxrdr.experiments.efficiency import compare_arms, step_ratios, target_fractions
    from cxrdr.experiments.efficiency_report import comparison_lines, step_ratio_lines

    rows = [{"run": "plain", "step_ms": 250.0}, {"run": "reinforced", "step_ms": 275.0}]
    got = step_ratios(rows, {"plain": 200.0, "reinforced": 202.0})
    assert got["reinforced"]["runs_ratio"] == pytest.approx(1.1)
    assert got["reinforced"]["bench_ratio"] == pytest.approx(1.01)
    assert "1.01x by the interleaved benchmark" in step_ratio_lines(got)[0]
    assert step_ratios(rows, {})["reinforced"]["bench_ratio"] is None

    def arm(ys, finals):
        return {"rows": [{"mean_recall": f} for f in finals],
                "seeds": [{"curve": [{"samples_seen": 100 * (i + 1), "mean_recall": y} for i, y in enumerate(ys)]}
                          for _ in finals]}

    trained = {"reinforced": arm([0.2, 0.4, 0.5, 0.5], [0.5, 0.52]),
               "plain-minilm": arm([0.1, 0.3, 0.4, 0.4], [0.4, 0.42])}
    c = compare_arms(trained, "reinforced", "plain-minilm", fractions=[1.0, 0.9])
    assert c["gap"] == pytest.approx(0.1) and c["two_sd_against"] == pytest.approx(2 * np.std([0.4, 0.42], ddof=1))
    assert [x["ratio"] for x in c["crossings"]] == pytest.approx([200 / 300, 180 / 260])
    text = "\n".join(comparison_lines(c))
    assert "## reinforced against plain-minilm" in text and "gap **0.1**" in text
    assert target_fractions({}) == [1.0, 0.95, 0.9] and target_fractions({"target_fractions": [0.9]}) == [1.0, 0.9]
    with pytest.raises(ValueError):
        target_fractions({"target_fractions": [1.5]})


def test_the_controls_recipe_changes_only_the_text_tower_of_plain_minilm():
    from pathlib import Path

    from cxrdr.experiments.efficiency import arm_plan, comparison_pairs
    from cxrdr.experiments.recipe_file import load_recipe
    from cxrdr.train.models.config import StudentConfig

    recipe, demo = load_recipe("configs/experiments/cpu-demo-controls.yaml"), load_recipe("cpu-demo")
    arm_runs, _, timed_only = arm_plan(recipe, Path(recipe["shards"]["dir"]), Path("unused"), build=False)
    assert timed_only == {"online"} and comparison_pairs(recipe["efficiency"], list(arm_runs))
    seeds = {n: [s for s, _ in runs] for n, runs in arm_runs.items()}
    assert len(seeds["plain"]) == 8 and len(seeds["plain-minilm"]) == len(seeds["reinforced"]) == 5
    assert seeds["plain-minilm-tuned"] == seeds["plain-minilm"][:3]
    tuned = arm_runs["plain-minilm-tuned"][0][1].to_dict()
    untuned = arm_runs["plain-minilm"][0][1].to_dict()
    assert {k for k in tuned if tuned[k] != untuned[k]} == {"out", "optim"}  # its own lr, nothing else
    assert {k for k in tuned["optim"] if tuned["optim"][k] != untuned["optim"][k]} == {"lr"}
    used = set(demo["efficiency"]["seeds"]) | {0, 1, 2}
    assert not used & {s for v in seeds.values() for s in v}  # fresh seeds
    (_, plain), (_, minilm) = arm_runs["plain"][0], arm_runs["plain-minilm"][0]
    a, b = plain.to_dict(), minilm.to_dict()
    assert a.pop("model_overrides") == {"global_pool": "avg"}
    assert b.pop("model_overrides") == {"global_pool": "avg", "text_tower": "minilm"}
    assert {k for k in a if a[k] != b[k]} == {"out"}
    assert StudentConfig.from_yaml(b["model"], text_tower="minilm").text_pool is None  # mean-pooled as the teacher's
    # cpu-demo's data, teacher and student settings, in folders of its own
    for key in ("train", "eval", "selection"):
        assert recipe[key] == demo[key], key
    for key in ("shards", "teachers", "report"):
        assert str(recipe[key]).replace("cpu-demo-controls", "cpu-demo") == str(
            demo[key] if key != "teachers" else dict(demo[key], models={"lite2-s1": {"source_seed": 1}})), key
    for key in ("model", "steps", "teachers", "optim", "loss"):
        assert recipe["efficiency"]["train"][key] == demo["efficiency"]["train"][key], key
    assert recipe["efficiency"]["runs"]["reinforced"]["optim"] == demo["efficiency"]["runs"]["reinforced"]["optim"]


def test_curve_plot_marks_where_each_arm_reaches_plain_and_the_samples_limit(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from cxrdr.experiments.efficiency_report import plot_bands

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at what was drawn
    curve = {"xs": [100, 200, 300], "mean": [0.1, 0.2, 0.3], "ci": [0.01, 0.01, 0.01]}
    arms = {"plain": {"curve_mean": curve, "plain_final_target": 0.3, "samples_to_plain_final": 300},
            "reinforced": {"curve_mean": curve, "plain_final_target": 0.3, "samples_to_plain_final": 250}}
    plot_bands(arms, "mean_recall", "mean recall", tmp_path / "curves.png", samples_limit=100.0)
    assert (tmp_path / "curves.png").is_file()
    lines = figures[0].axes[0].get_lines()
    crossings = [ln for ln in lines if ln.get_marker() == "v"]
    # every arm is marked where it first reaches plain's final, plain's own crossing included
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in crossings] == [([300], [0.3]), ([250], [0.3])]
    limit = [ln for ln in lines if ln.get_label() == "1/3 of plain's first crossing"]
    assert len(limit) == 1 and list(limit[0].get_xdata()) == [100.0, 100.0]


def test_recipe_errors_are_one_line(tmp_path):
    from cxrdr.experiments.recipe_file import load_recipe

    bad = tmp_path / "bad.yaml"
    bad.write_text("shards: {dir: x}\nbogus: 1\n")
    with pytest.raises(ValueError, match="unknown experiment key"):
        load_recipe(bad)
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")


def test_a_recipe_extends_another_key_by_key(tmp_path):
    """``extends``: the base recipe with the file's keys laid over; mappings merge, null removes a key, lists
    replace; name and folder are the file's own; a loop of extends is an error naming it."""
    from cxrdr.experiments.recipe_file import load_recipe, overlay, recipe_out

    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"out": "runs/base", "shards": {"dir": "s", "build": {"n_aug": 2, "seed": 0}},
                                    "efficiency": {"seeds": [10, 11], "runs": {"plain": {"mode": "plain"},
                                                                               "online": {"mode": "reinforced"}}}}))
    mid = tmp_path / "mid.yaml"
    mid.write_text(yaml.safe_dump({"extends": str(base), "shards": {"build": {"n_aug": 4}}}))
    probe = tmp_path / "probe.yaml"
    probe.write_text(yaml.safe_dump({"extends": str(mid), "efficiency": {"seeds": [0], "runs": {"online": None}}}))
    recipe = load_recipe(probe)
    assert recipe["shards"] == {"dir": "s", "build": {"n_aug": 4, "seed": 0}}
    assert recipe["efficiency"] == {"seeds": [0], "runs": {"plain": {"mode": "plain"}}}
    assert recipe["name"] == "probe" and str(recipe_out(recipe)) == "runs/experiments/probe"
    assert recipe["_extends"] == [str(mid), str(base)] and "extends" not in recipe
    assert load_recipe(base)["efficiency"]["runs"]["online"] == {"mode": "reinforced"}  # the base is unchanged
    assert overlay({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}
    base.write_text(yaml.safe_dump({"extends": str(probe), "shards": {"dir": "s"}}))
    with pytest.raises(ValueError, match="comes back to a recipe it extends"):
        load_recipe(probe)


def test_ablation_over_seeds_reports_mean_sd_and_chance_and_reuses_runs(micro_recipe):
    from typer.testing import CliRunner

    from cxrdr.cli import train_app as app

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
    assert " ± " in table and "mean R chance" in table and "PG z chance" in table and "PG z train prior" in table
    e_row = data["table"][1]
    assert e_row["mean_recall_ci"] == pytest.approx(12.7062 * e_row["mean_recall_sd"] / 2 ** 0.5, rel=1e-4)  # 95 % t
    assert [b["bar"].split()[:2] for b in data["bars"]] == [["E", "pointing_z"], ["E", "pointing_attn"]]
    assert "## Bars" in table and data["protocol"]["report_split"] == "test"
    # E's pointing games against the train-box prior, pooled over seeds; A has no patch mask and no local head
    _assert_pooled_margins(data["margins_over_train_prior"]["E"], [s["final"] for s in data["runs"]["E"]["seeds"]])
    assert "A" not in data["margins_over_train_prior"]
    assert "Pointing games − train-box prior" in table
    # a second invocation reuses the finished runs and their evaluations
    eval_json = out / "runs" / "variant-A" / "seed-0" / "eval-test" / "eval.json"
    stamp = eval_json.stat().st_mtime
    again = CliRunner().invoke(app, ["experiment", "ablation", "--config", str(path), "--quiet"])
    assert again.exit_code == 0, again.output
    assert eval_json.stat().st_mtime == stamp
    assert json.loads((out / "results.json").read_text())["table"][0]["mean_recall"] == data["table"][0]["mean_recall"]


def test_a_run_claimed_by_another_process_is_left_alone(tmp_path):
    """Two copies of an experiment share its runs: a run folder another process holds is not cleared or
    trained; claim_run(wait=False) says so, and clearing a claimed folder keeps the lock file (deleting it
    would let a second process lock a fresh file of the same name and write into the same folder)."""
    from cxrdr.common.locking import FOLDER_LOCK, lock_folder
    from cxrdr.experiments.runs import _clear_run_folder, claim_run

    run = tmp_path / "variant-A" / "seed-0"
    (run / "eval-test").mkdir(parents=True)
    (run / "last.pt").write_bytes(b"partial")
    other = lock_folder(run, "train experiment")  # another process (its own open file)
    assert claim_run(run, wait=False) is None
    other.release()
    mine = claim_run(run, wait=False)
    assert mine is not None
    _clear_run_folder(run)
    assert [p.name for p in run.iterdir()] == [FOLDER_LOCK]
    assert claim_run(run, wait=False) is None  # still held by this claim, through the same file
    mine.release()


def test_claimed_in_turn_does_the_free_runs_first_then_waits_for_the_busy_one(tmp_path):
    """Two copies of an experiment split its runs: the folder another process holds is skipped on the first
    pass (on_busy hears of it) and done once that process lets go, each run's work holding its lock."""
    from cxrdr.common.locking import lock_folder
    from cxrdr.experiments.runs import claim_run, claimed_in_turn

    runs = [tmp_path / name for name in ("a", "b", "c")]
    for run in runs:
        run.mkdir()
    other = lock_folder(runs[1], "train experiment")  # another copy is training run b
    order, busy = [], []

    def work(run, lock):
        assert claim_run(run, wait=False) is None  # held while the work runs
        order.append(run.name)
        return run.name.upper()

    def on_busy(run):
        busy.append(run.name)
        other.release()  # the other copy finishes run b

    done = claimed_in_turn(runs, work, on_busy)
    assert order == ["a", "c", "b"] and busy == ["b"]
    assert done == {runs[0]: "A", runs[1]: "B", runs[2]: "C"}
    assert claim_run(runs[1], wait=False) is not None  # released after its work


def test_one_copy_times_the_step_benchmark_and_writes_the_results_the_other_waits_and_takes_them(tmp_path):
    """Two copies of an experiment both reach its last stage: the first claims it (step benchmark, results.json);
    the second waits (timing the steps together, each would measure the other's load) and returns the
    results.json written meanwhile; a copy that finds none written while it waited takes the stage itself."""
    import threading

    from cxrdr.experiments.runs import claim_results

    out = tmp_path / "efficiency"
    out.mkdir()
    (out / "results.json").write_text('{"stale": true}')  # an earlier run's: not what the second copy waits for
    first, none = claim_results(out)
    assert first is not None and none is None

    def finish():
        (out / "results.json").write_text('{"experiment": "efficiency", "by": "first"}')
        first.release()

    timer = threading.Timer(0.3, finish)
    timer.start()
    try:
        lock, results = claim_results(out, poll_s=0.05)
    finally:
        timer.join()
    assert lock is None and results == {"experiment": "efficiency", "by": "first"}

    first, _ = claim_results(out)
    threading.Timer(0.2, first.release).start()  # the first copy fails: nothing written
    lock, results = claim_results(out, poll_s=0.05)
    assert results is None and lock is not None  # this copy does the stage
    lock.release()


def test_a_second_copy_waits_for_the_teachers_the_first_prepares(tmp_path):
    """prepare_teachers holds the teachers folder: a second copy of the experiment waits for the first to
    finish (then reuses its teachers) instead of training them alongside."""
    import threading

    from cxrdr.common.locking import lock_folder
    from cxrdr.experiments.teacher_prep import prepare_teachers

    root = tmp_path / "teachers"
    first = lock_folder(root, "train experiment")  # the first copy, busy preparing
    released = threading.Event()

    def finish():
        released.set()
        first.release()

    timer = threading.Timer(0.5, finish)
    timer.start()
    try:
        assert prepare_teachers({"teachers": {"dir": str(root), "models": {}}}, lambda: tmp_path / "shards") == {}
    finally:
        timer.cancel()
    assert released.is_set()  # it returned only after the first copy let go


def test_a_second_copy_waits_for_a_shard_folder_the_first_builds(tmp_path):
    """Two copies of an experiment reaching a missing shard folder (e.g. plain-more-data's own shards): the
    second waits for the first's build and reuses the folder instead of failing on its build lock."""
    import threading

    from cxrdr.common.locking import lock_folder
    from cxrdr.experiments.runs import ensure_shards

    out = tmp_path / "more-data-shards"
    first = lock_folder(tmp_path / ".more-data-shards.building", "train experiment")  # the first copy, building
    released = threading.Event()

    def finish():  # the first copy's build completes
        out.mkdir()
        (out / "dataset.json").write_text("{}")
        released.set()
        first.release()

    timer = threading.Timer(0.5, finish)
    timer.start()
    try:  # no build options: building here would raise, so returning proves it reused the first copy's folder
        assert ensure_shards({"dir": str(out)}, progress=False) == out
    finally:
        timer.cancel()
    assert released.is_set()


def test_a_second_copy_prepares_the_teachers_while_the_first_builds_the_students_shards(tmp_path, monkeypatch):
    """The set-up split between two copies: the one that finds the students' shards being built makes the teachers'
    own part meanwhile (here: the call, and what it saw), then waits for the folder; a lone copy builds first."""
    import threading

    from cxrdr.common.locking import lock_folder
    from cxrdr.experiments import teacher_prep
    from cxrdr.experiments.runs import ensure_shards

    out = tmp_path / "shards"
    recipe = {"shards": {"dir": str(out)}}  # no build options: building here would raise
    seen = []
    monkeypatch.setattr(teacher_prep, "prepare_teachers",
                        lambda r, students, progress, experiment: seen.append((out / "dataset.json").is_file())
                        or {"t": 1})
    first = lock_folder(tmp_path / ".shards.building", "train experiment")  # the first copy, building
    assert ensure_shards(recipe["shards"], progress=False, wait=False) is None

    def finish():  # the first copy's build completes
        out.mkdir()
        (out / "dataset.json").write_text("{}")
        first.release()

    timer = threading.Timer(0.5, finish)
    timer.start()
    try:
        assert teacher_prep.students_and_teachers(recipe, False, "efficiency") == (out, {"t": 1})
    finally:
        timer.cancel()
    assert seen == [False]  # the teachers were prepared while the students' shards were still being built
    assert teacher_prep.students_and_teachers(recipe, False, "efficiency") == (out, {"t": 1}) and seen[-1]
    teacher_prep._refuse_stale(tmp_path / "not-built-yet", "lite2-s1")  # an unbuilt folder holds no teacher


def test_the_set_up_makes_the_students_shards_once_however_often_the_teachers_need_them(tmp_path, monkeypatch):
    """``shards.rebuild: true`` rebuilds the students' folder once per command: the teachers' steps that need it
    (their evaluation on it, add-teacher) get the folder made, not a rebuild that would drop an added teacher."""
    from cxrdr.experiments import runs, teacher_prep

    out = tmp_path / "shards"
    builds = []

    def fake_build(folder, spec, progress):
        builds.append(folder)
        folder.mkdir(exist_ok=True)
        (folder / "dataset.json").write_text("{}")
        return folder

    monkeypatch.setattr(runs, "_build_shards", fake_build)
    monkeypatch.setattr(teacher_prep, "prepare_teachers",
                        lambda r, students, progress, experiment: {"needs": [students(), students()]})
    shards, teachers = teacher_prep.students_and_teachers({"shards": {"dir": str(out), "rebuild": True}}, False)
    assert shards == out and teachers == {"needs": [out, out]} and builds == [out]


def test_a_runs_loss_and_optim_overrides_add_to_the_experiments_and_old_run_configs_still_match(tmp_path):
    from cxrdr.experiments.recipe import train_config
    from cxrdr.experiments.runs import _finished_alike

    recipe = {"train": {"model": "tiny-A", "steps": 5, "loss": {"lambda_distill": 0.7}},
              "efficiency": {"train": {"optim": {"lr": 0.002, "warmup_steps": 3},
                                       "loss": {"lambda_distill": 1.0, "w_affinity": 50.0}}}}
    run = tmp_path / "run"
    cfg = train_config(recipe, tmp_path / "shards", run, {"optim": {"lr": 0.004}, "loss": {"w_feature": 50.0}},
                       "efficiency")
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (0.004, 3)  # the run's lr, the experiment's warm-up
    assert (cfg.loss.lambda_distill, cfg.loss.w_affinity, cfg.loss.w_feature) == (1.0, 50.0, 50.0)
    # a finished run saved before loss.w_feature existed is the same run at its default (0: off)
    plain = train_config(recipe, tmp_path / "shards", run, {"mode": "plain"}, "efficiency")
    run.mkdir()
    for name in ("summary.json", "last.pt"):
        (run / name).write_text("{}")
    saved = plain.to_dict()
    del saved["loss"]["w_feature"]
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert _finished_alike(run, plain)
    assert not _finished_alike(run, train_config(recipe, tmp_path / "shards", run, {"mode": "plain", "steps": 6},
                                                 "efficiency"))
    # how often last.pt is written does not change the run (a recipe's save_every may change between leases)
    assert _finished_alike(run, train_config(recipe, tmp_path / "shards", run, {"mode": "plain", "save_every": 7},
                                             "efficiency"))
    # nor does how often the loss balance is measured (a carried run saved before balance_every existed)
    assert _finished_alike(run, train_config(recipe, tmp_path / "shards", run, {"mode": "plain", "balance_every": 0},
                                             "efficiency"))
    # nor the frozen stem's memo (the same outputs)
    assert _finished_alike(run, train_config(recipe, tmp_path / "shards", run, {"mode": "plain", "frozen_memo_mb": 0},
                                             "efficiency"))
    # nor the heads' CUDA graphs (they replay the eager heads; a carried run saved before the setting existed)
    assert _finished_alike(run, train_config(recipe, tmp_path / "shards", run,
                                             {"mode": "plain", "cuda_graphs_heads": "auto",
                                              "cuda_graphs_losses": "on"}, "efficiency"))
    saved["loss"]["w_gone"] = 1.0  # a field this version does not know: not the same run
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert not _finished_alike(run, plain)


def test_ladder_bars_need_the_floor_and_the_margin_over_the_train_prior():
    from cxrdr.experiments.ablation import ladder_bars

    rows = [{"run": "D", "pointing_z": 0.85, "train_prior_pointing_z": 0.55, "pointing_attn": 0.72,
             "train_prior_pointing_attn": 0.62},
            {"run": "A", "pointing_z": 0.1}]
    bars = {b["bar"].split()[1]: b for b in ladder_bars(rows)}
    assert set(bars) == {"pointing_z", "pointing_attn"}  # only the headline variants present
    assert bars["pointing_z"]["met"] and bars["pointing_z"]["limit"] == pytest.approx(0.80)
    assert bars["pointing_attn"]["met"] is False and bars["pointing_attn"]["limit"] == pytest.approx(0.77)
    assert ladder_bars([{"run": "E", "pointing_z": 0.9}])[0]["met"] is None  # no prior: not judged


def test_teacher_image_overlap_is_measured_from_the_stored_images(tmp_path):
    from cxrdr.experiments.efficiency_report import _teacher_images
    from cxrdr.experiments.teacher_prep import shared_train_images

    def build(name, samples, store_size=128):
        """A shards folder as far as the overlap reads it: dataset.json and per-shard stats (key -> CRC-32s)."""
        folder = tmp_path / name
        (folder / "stats").mkdir(parents=True)
        splits = ("train", "test")
        (folder / "dataset.json").write_text(json.dumps({
            "schema_version": 3, "store_size": store_size, "image_format": "jpg", "jpeg_quality": 95,
            "shards": [{"name": f"shard-{i:06d}.tar.gz", "split": split} for i, split in enumerate(splits)]}))
        for i, split in enumerate(splits):
            rows = {k: {"jpg": crc, "json": "00"} for k, crc, s in samples if s == split}
            (folder / "stats" / f"shard-{i:06d}.json").write_text(
                json.dumps({"split": split, "checksums": {"algorithm": "crc32", "samples": rows}}))
        return folder

    students = build("students", [("a", "1", "train"), ("b", "2", "train"), ("c", "3", "test")])
    same = build("same", [("a", "1", "train"), ("b", "2", "train"), ("c", "3", "test")])
    half = build("half", [("a", "1", "train"), ("z", "9", "train")])
    # a phantom draw of another seed: the same keys, other images; a shared test image is no training image
    other_seed = build("other", [("a", "7", "train"), ("b", "8", "train"), ("c", "3", "test")])
    assert shared_train_images(same, students) == 1.0
    assert shared_train_images(half, students) == 0.5
    assert shared_train_images(other_seed, students) == 0.0
    assert shared_train_images(build("bigger", [("a", "1", "train")], store_size=256), students) is None
    assert shared_train_images(tmp_path / "missing", students) is None
    assert "students' own training images" in _teacher_images(1.0)
    assert "never see" in _teacher_images(0.0) and "50%" in _teacher_images(0.5)


def test_table_cells_print_an_interval_as_bounds_and_a_half_width_with_plus_minus():
    from cxrdr.train.evaluation.report import markdown_table_sd

    rows = [{"run": "plain", "samples_ratio": 1.0, "samples_ratio_ci": [0.4491884, float("inf")],
             "mean_recall": 0.2, "mean_recall_ci": 0.05}]
    table = markdown_table_sd(rows, ["samples_ratio", "mean_recall"], spread="ci")
    assert "| 1.000 [0.449, inf] | 0.200 ± 0.050 |" in table


def test_every_shipped_recipe_names_a_selection_set_apart_from_its_report_set():
    """The protocol lives in the recipes (docs/protocol.md): settings are chosen on val, figures read a set
    no choice reads — the test split, or an evaluation set of its own."""
    from cxrdr.common.configs import config_dir
    from cxrdr.experiments.recipe_file import load_recipe
    from cxrdr.experiments.teacher_prep import teacher_plans

    recipes = [p for p in sorted(config_dir("experiments").glob("*.yaml"))
               if {"efficiency", "ablation"} & set(yaml.safe_load(p.read_text()))]
    assert {p.stem for p in recipes} >= {"cpu-demo", "cpu-ladder", "nih", "mimic-12m-style"}
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe.get("selection", {}).get("split") == "val", path.name
        report = recipe.get("report") or {}
        if path.stem.endswith("-probe"):  # a probe chooses a setting: every figure it writes reads val
            spec = recipe["efficiency"]
            assert report == {"split": "val"} and spec["curve_split"] == "val", path.name
            assert (recipe.get("teachers") or {}).get("evaluate", []) == [], path.name
            # and its plan evaluates no teacher (an empty list once fell back to the defaults: 54 s of a lease)
            assert all(plan["evaluate"] == [] for plan in teacher_plans(recipe).values()), path.name
            assert not set(spec["seeds"]) & set(load_recipe(recipe["_extends"][0])["efficiency"]["seeds"]), path.name
            continue
        assert report.get("shards") or report.get("split") == "test", path.name


def test_mean_curve_without_intervals_has_the_same_means():
    """The bootstraps' fast path (no t quantile per point) averages exactly as the reported curve does."""
    from cxrdr.experiments.stats import mean_curve

    curves = [[{"samples_seen": 32 * i, "mean_recall": 0.1 * i + 0.01 * s} for i in range(1, 6)] for s in range(3)]
    curves[1].append({"samples_seen": 192, "mean_recall": 0.9})  # a point only one seed has: left out
    curves[2][1]["mean_recall"] = None                           # a missing value: averaged over the others
    full, fast = mean_curve(curves), mean_curve(curves, with_ci=False)
    assert fast["xs"] == full["xs"] == [32, 64, 96, 128, 160]
    assert fast["mean"] == full["mean"] and fast["ci"] is None and len(full["ci"]) == 5
    assert full["mean"][1] == (0.2 + 0.21) / 2


def test_the_train_command_starts_without_the_trainer_the_experiments_or_open_clip():
    """`train --help` and every `train` command's start import only the command line (7.0 -> 2.5 s on the 2-core
    box): the experiments' modules, the trainer and open_clip (only an export and an open_clip-initialised student
    need it) are imported by the command that uses them."""
    import subprocess
    import sys

    heavy = ["timm", "transformers", "open_clip", "cxrdr.train.loop", "cxrdr.train.models",
             "cxrdr.experiments.efficiency"]
    code = f"import sys, cxrdr.cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
