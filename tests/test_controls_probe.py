"""scripts/controls_probe.py: each candidate is the arm's run config with one change, seed 0 on the val split,
and the choice follows the probe's rule (for the distillation probe: the current setting stays unless the best
is ahead of it by more than the margin)."""
from __future__ import annotations

import json
import pytest
import yaml

from tests.script_loader import load_script

BASE = {"seed": 20, "eval_split": "test", "eval_shards": "report", "eval_every": 10, "out": "x", "steps": 400,
        "optim": {"lr": 0.001, "weight_decay": 0.1},
        "loss": {"lambda_distill": 1.0, "w_affinity": 50.0, "w_feature": 50.0}}


@pytest.fixture()
def probe_script(tmp_path, monkeypatch):
    script = load_script("scripts/controls_probe.py")
    monkeypatch.setattr(script, "PROBES_DIR", tmp_path / "probes")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": {"reinforced-minilm": [{"train_config": BASE}],
                                            "plain-minilm": [{"train_config": BASE}]}}))
    for name in ("distill", "lr"):
        monkeypatch.setitem(script.PROBES, name, script.PROBES[name]._replace(results=results))
    return script


def _write_curve(run, finals):
    run.mkdir(parents=True)
    lines = [{"kind": "train", "step": 40}]
    lines += [{"kind": "eval", "step": step, "samples_seen": 32 * step, "mean_recall": value}
              for step, value in finals]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))


def test_candidates_change_one_thing_and_validate_on_val_with_seed_0(probe_script):
    paths = probe_script.write_configs(probe_script.PROBES["distill"])
    assert [p.name for p in paths] == ["reinforced-minilm-current.yaml", "reinforced-minilm-kl-only.yaml",
                                       "reinforced-minilm-weights-5.yaml", "reinforced-minilm-lambda-0.5.yaml"]
    configs = {p.stem.removeprefix("reinforced-minilm-"): yaml.safe_load(p.read_text()) for p in paths}
    for label, cfg in configs.items():
        assert (cfg["seed"], cfg["eval_split"], cfg["eval_shards"]) == (0, "val", None)
        assert cfg["out"].endswith(f"reinforced-minilm-{label}") and cfg["optim"] == BASE["optim"]
    assert configs["current"]["loss"] == BASE["loss"]
    assert configs["kl-only"]["loss"] == {"lambda_distill": 1.0, "w_affinity": 0.0, "w_feature": 0.0}
    assert configs["lambda-0.5"]["loss"] == {"lambda_distill": 0.5, "w_affinity": 50.0, "w_feature": 50.0}
    assert BASE["loss"]["w_affinity"] == 50.0  # the base is copied, not changed


@pytest.mark.parametrize("kl_only_final, chosen", [(0.52, "current"), (0.53, "kl-only")])
def test_distill_probe_keeps_the_current_setting_unless_ahead_by_more_than_the_margin(
        probe_script, kl_only_final, chosen):
    probe = probe_script.PROBES["distill"]
    finals = {"current": 0.515, "kl-only": kl_only_final, "weights-5": 0.40, "lambda-0.5": 0.45}
    for label, final in finals.items():
        _write_curve(probe_script.run_dir(probe, label), [(40, 0.1), (400, final)])
    out = probe_script.summary(probe)
    assert out["best"] == "kl-only" and out["best_ahead_of_current"] == pytest.approx(kl_only_final - 0.515)
    assert out["margin"] == 0.010 and out["rule"] == ("highest final val mean R; it replaces the current setting only "
                                                      "if ahead of it by more than 0.010")
    assert out["chosen"] == chosen
    assert out["runs"]["weights-5"]["w_affinity"] == 5.0 and out["runs"]["kl-only"]["final_mean_recall"] == kl_only_final


def test_lr_probe_names_its_choice_by_lr_and_keeps_a_stopped_run_apart(probe_script):
    probe = probe_script.PROBES["lr"]
    for lr, curve in {0.0005: [(400, 0.53)], 0.001: [(400, 0.57)], 0.002: [(200, 0.06)]}.items():
        _write_curve(probe_script.run_dir(probe, f"lr{lr}"), curve)
    out = probe_script.summary(probe)
    assert out["chosen_lr"] == 0.001 and set(out["runs"]) == {"0.0005", "0.001", "0.002"}
    assert out["rule"] == "highest final val mean R" and "margin" not in out
    assert out["runs"]["0.002"]["stopped_at"] == 200 and "final_mean_recall" not in out["runs"]["0.002"]


def test_a_run_without_validation_is_named(probe_script):
    probe = probe_script.PROBES["lr"]
    for lr in probe_script.LRS:
        _write_curve(probe_script.run_dir(probe, f"lr{lr}"), [])
    with pytest.raises(SystemExit, match="plain-minilm-lr0.0005: no validation"):
        probe_script.summary(probe)
