#!/usr/bin/env python
"""The learning-rate probe of cpu-demo-controls' pretrained-text plain arm (issue 37 part 3).

plain-minilm ran at plain's lr (2e-3, chosen on val for the from-scratch tiny text tower); one of its seeds
collapsed to chance. This probe chooses its lr the way plain's and the teacher arms' were chosen: seed 0,
the training shards' val split, final val mean R, every candidate otherwise the arm's own run config.

    python scripts/controls_lr_probe.py configs [RESULTS]   # write runs/probes/plain-minilm-lr<LR>.yaml
    for c in runs/probes/plain-minilm-lr*.yaml; do train run --config $c; done   # ~23 min each, 1 thread
    python scripts/controls_lr_probe.py summary > docs/results/cpu-demo-controls-lr-probe.json

RESULTS: the controls' results.json (default docs/results/cpu-demo-controls.json), whose plain-minilm run
config every candidate copies (its shards must exist: run the recipe first).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

LRS = (0.0005, 0.001, 0.002)
PROBES = Path("runs/probes")


def write_configs(results: Path) -> None:
    base = json.loads(results.read_text())["runs"]["plain-minilm"][0]["train_config"]
    PROBES.mkdir(parents=True, exist_ok=True)
    for lr in LRS:
        cfg = dict(base, optim=dict(base["optim"], lr=lr), seed=0, eval_split="val", eval_shards=None,
                   eval_every=40, out=str(PROBES / f"plain-minilm-lr{lr}"))
        (PROBES / f"plain-minilm-lr{lr}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def summary(steps: int = 400) -> dict:
    """Per lr: the val curve (step, samples, mean R) and its final; the choice is the highest final among
    the runs that finished. A run stopped early is kept with ``stopped_at`` and its last value, and named:
    it is the choice's reader's to judge whether it could have overtaken."""
    out = {"probe": "plain-minilm lr, seed 0, training shards' val split, final val mean R",
           "rule": "highest final val mean R", "steps": steps, "runs": {}}
    for lr in LRS:
        lines = [json.loads(line) for line in (PROBES / f"plain-minilm-lr{lr}" / "metrics.jsonl").open()]
        curve = [{"step": d["step"], "samples_seen": d.get("samples_seen"), "mean_recall": d["mean_recall"]}
                 for d in lines if d.get("kind") == "eval" and "mean_recall" in d]
        if not curve:
            raise SystemExit(f"plain-minilm-lr{lr}: no validation in its metrics.jsonl")
        run = {"lr": lr, "curve": curve}
        if curve[-1]["step"] >= steps:
            run["final_mean_recall"] = curve[-1]["mean_recall"]
        else:
            run.update(stopped_at=curve[-1]["step"], last_mean_recall=curve[-1]["mean_recall"])
        out["runs"][str(lr)] = run
    finished = [r for r in out["runs"].values() if "final_mean_recall" in r]
    out["chosen_lr"] = max(finished, key=lambda r: r["final_mean_recall"])["lr"] if finished else None
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["configs"]:
        write_configs(Path(sys.argv[2] if len(sys.argv) > 2 else "docs/results/cpu-demo-controls.json"))
    elif sys.argv[1:2] == ["summary"]:
        print(json.dumps(summary(), indent=1))
    else:
        raise SystemExit(__doc__)
