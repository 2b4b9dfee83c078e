#!/usr/bin/env python
"""Val probes of the CPU controls' arms: one setting per candidate, seed 0, the training shards' val split.

Each probe copies one arm's run config from a committed results file and changes one thing per candidate,
the way plain's and the teacher arms' settings were chosen: seed 0, the training shards' val split, final
val mean R (no figure of the report set is read).

    python scripts/controls_probe.py configs PROBE   # write runs/probes/<arm>-<candidate>.yaml
    for c in runs/probes/<arm>-*.yaml; do train run --config $c; done
    python scripts/controls_probe.py summary PROBE > docs/results/<the probe's results file>

PROBE:
  lr       plain-minilm's lr (issue 37 part 3): it ran at plain's 2e-3, chosen for the from-scratch tiny text
           tower, and one of its seeds collapsed to chance. docs/results/cpu-demo-controls-lr-probe.json
  distill  reinforced-minilm's distillation terms (issue 36 at CPU size): with the pretrained text tower the
           recipe's objective (lambda 1, affinity and feature at 50) ends below plain CLIP; the candidates are
           the GPU probe's first four reinforced settings (configs/experiments/gpu-efficiency-probe.yaml).
           The rule, fixed before any candidate ran, is the GPU probe's: the best final val mean R replaces
           the current setting only if it is ahead of it by more than 0.010.
           docs/results/cpu-demo-controls-distill-probe.json
The arm's shards (and teacher embeddings) must exist: run its recipe first.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import yaml

PROBES_DIR = Path("runs/probes")
RESULTS = Path("docs/results")


class Probe(NamedTuple):  # not a dataclass: the tests load this script without a module entry
    describe: str               # what is probed, for the summary
    results: Path               # the committed results file whose arm's run config every candidate copies
    arm: str
    candidates: dict[str, dict]  # label -> overrides of the arm's train config (nested dicts merge one level)
    choice_field: str | None = None  # the summary names the choice by this field of the winner (else its label)
    keep: str | None = None     # the current setting's label: kept unless the best is ahead by > margin
    margin: float = 0.0
    rule: str = "highest final val mean R"


LRS = (0.0005, 0.001, 0.002)
PROBES = {
    "lr": Probe("plain-minilm lr, seed 0, training shards' val split, final val mean R",
                RESULTS / "cpu-demo-controls.json", "plain-minilm",
                {f"lr{lr}": {"optim": {"lr": lr}} for lr in LRS}, choice_field="lr"),
    "distill": Probe(
        "reinforced-minilm's distillation terms, seed 0, training shards' val split, final val mean R",
        RESULTS / "cpu-demo-controls-reinforced-minilm.json", "reinforced-minilm",
        {"current": {},
         "kl-only": {"loss": {"w_affinity": 0.0, "w_feature": 0.0}},
         "weights-5": {"loss": {"w_affinity": 5.0, "w_feature": 5.0}},
         "lambda-0.5": {"loss": {"lambda_distill": 0.5}}},
        keep="current", margin=0.010),
}


def candidate_config(base: dict, overrides: dict, out: Path) -> dict:
    """BASE (a run's saved train config) with OVERRIDES laid over, seed 0, validated on the val split."""
    cfg = dict(base)
    for key, value in overrides.items():
        cfg[key] = dict(base[key], **value) if isinstance(value, dict) else value
    return dict(cfg, seed=0, eval_split="val", eval_shards=None, eval_every=40, out=str(out))


def run_dir(probe: Probe, label: str) -> Path:
    return PROBES_DIR / f"{probe.arm}-{label}"


def write_configs(probe: Probe) -> list[Path]:
    base = json.loads(probe.results.read_text())["runs"][probe.arm][0]["train_config"]
    PROBES_DIR.mkdir(parents=True, exist_ok=True)
    written = []
    for label, overrides in probe.candidates.items():
        path = PROBES_DIR / f"{probe.arm}-{label}.yaml"  # not with_suffix: labels hold dots (lambda-0.5)
        path.write_text(yaml.safe_dump(candidate_config(base, overrides, run_dir(probe, label)), sort_keys=False))
        written.append(path)
    return written


def val_curve(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    curve = [{"step": d["step"], "samples_seen": d.get("samples_seen"), "mean_recall": d["mean_recall"]}
             for d in lines if d.get("kind") == "eval" and "mean_recall" in d]
    if not curve:
        raise SystemExit(f"{run}: no validation in its metrics.jsonl")
    return curve


def _setting(probe: Probe, label: str) -> dict:
    """A candidate's changed fields, flat (``optim.lr`` -> ``lr``), as the summary records them."""
    flat = {}
    for value in probe.candidates[label].values():
        flat.update(value if isinstance(value, dict) else {})
    return flat


def summary(probe: Probe, steps: int = 400) -> dict:
    """Per candidate: the val curve (step, samples, mean R) and its final; the choice follows the probe's
    rule among the runs that finished. A run stopped early is kept with ``stopped_at`` and its last value,
    and named: it is the choice's reader's to judge whether it could have overtaken."""
    rule = probe.rule if probe.keep is None else (f"{probe.rule}; it replaces the {probe.keep} setting only if "
                                                  f"ahead of it by more than {probe.margin:.3f}")
    out = {"probe": probe.describe, "rule": rule, "steps": steps, "runs": {}}
    if probe.keep is not None:
        out["margin"] = probe.margin
    for label in probe.candidates:
        curve = val_curve(run_dir(probe, label))
        run = {**_setting(probe, label), "curve": curve}
        if curve[-1]["step"] >= steps:
            run["final_mean_recall"] = curve[-1]["mean_recall"]
        else:
            run.update(stopped_at=curve[-1]["step"], last_mean_recall=curve[-1]["mean_recall"])
        key = str(run[probe.choice_field]) if probe.choice_field else label
        out["runs"][key] = run
    finished = {k: r for k, r in out["runs"].items() if "final_mean_recall" in r}
    best = max(finished, key=lambda k: finished[k]["final_mean_recall"]) if finished else None
    if best is not None and probe.keep is not None and probe.keep in finished:
        ahead = finished[best]["final_mean_recall"] - finished[probe.keep]["final_mean_recall"]
        out["best"], out["best_ahead_of_current"] = best, ahead
        best = best if ahead > probe.margin else probe.keep
    if probe.choice_field:
        out[f"chosen_{probe.choice_field}"] = finished[best][probe.choice_field] if best is not None else None
    else:
        out["chosen"] = best
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("configs", "summary") or argv[1] not in PROBES:
        raise SystemExit(__doc__)
    probe = PROBES[argv[1]]
    if argv[0] == "configs":
        for path in write_configs(probe):
            print(path)
    else:
        print(json.dumps(summary(probe), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
