#!/usr/bin/env python
"""Tables of docs/real-radiographs.md from the NIH runs: every arm's box-benchmark results (benchmark.json) over
seeds as mean ± 95 % CI (t-interval), overall and per finding, beside chance, the leave-one-out prior and the train
split's box-frequency prior.
  python scripts/nih-tables.py [EXPERIMENT_DIR] [TRANSFER_DIR] > tables.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cxrdr.common.nih import BOX_FINDINGS
from cxrdr.experiments.margins import benchmark_hit_blocks, margins_markdown, pooled_margins
from cxrdr.experiments.stats import t_interval

EXP = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/experiments/nih")
TRANSFER = Path(sys.argv[2] if len(sys.argv) > 2 else "runs/experiments/nih-transfer")


def arms() -> dict[str, list[dict]]:
    """arm -> benchmark.json of each seed (test split)."""
    found = {
        "plain (NIH train only)": sorted((EXP / "efficiency/runs/plain").glob("seed-*/eval-test/benchmark/benchmark.json")),
        "reinforced (NIH teacher, stored)": sorted(
            (EXP / "efficiency/runs/reinforced").glob("seed-*/eval-test/benchmark/benchmark.json")),
        "transfer (phantom only, no real training)": [TRANSFER / "transfer-bench/benchmark.json"],
        "phantom -> fine-tuned on NIH train": sorted((TRANSFER / "finetune").glob("seed-*/bench/benchmark.json")),
    }
    return {k: [json.loads(p.read_text()) for p in v if p.is_file()] for k, v in found.items()}


def cell(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    mean, half = t_interval(values)
    return f"{mean:.3f}" + (f" ± {half:.3f}" if half is not None else "")


def summary_table(data: dict) -> list[str]:
    cols = [("zero-shot AUC (blind 0.5)", "zero_shot_auc_mean"), ("PG z", "pg_z"), ("z chance", "pg_z_chance"),
            ("z LOO prior", "pg_z_prior"), ("z train prior", "pg_z_train_prior"), ("PG attn", "pg_attention"),
            ("attn chance", "pg_attention_chance"), ("attn LOO prior", "pg_attention_prior"),
            ("attn train prior", "pg_attention_train_prior"), ("T(IoBB)>0.1 z", "iobb_0.1_z"),
            ("T(IoBB)>0.1 attn", "iobb_0.1_attention"), ("IoU z", "iou_z"), ("IoU attn", "iou_attention")]
    out = ["| arm | seeds | " + " | ".join(c for c, _ in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for arm, runs in data.items():
        out.append(f"| {arm} | {len(runs)} | " + " | ".join(cell([r['summary'].get(k) for r in runs]) for _, k in cols)
                   + " |")
    return out


def per_finding(runs: list[dict], title: str) -> list[str]:
    out = [f"**{title}** ({len(runs)} seeds; mean ± 95 % CI; PG as model / chance / LOO prior / train prior)", "",
           "| finding | n pos / boxes | zero-shot AUC | PG attn | (chance / LOO / train prior) | PG z | "
           "(chance / LOO / train prior) | T(IoBB)>0.1 attn | >0.25 | >0.5 | train prior >0.1 |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]

    def loc(r, kind, f, base, metric):
        return ((r["localisation"][kind]["per_finding"].get(f) or {}).get(base) or {}).get(metric)

    for f in BOX_FINDINGS:
        zs = [r["zeroshot"]["per_finding"].get(f, {}).get("auc") for r in runs]
        n_pos = (runs[0]["zeroshot"]["per_finding"].get(f) or {}).get("n_pos")
        n_box = (runs[0]["localisation"]["attention"]["per_finding"].get(f) or {}).get("n_boxes")
        base = lambda kind: " / ".join(cell([loc(r, kind, f, b, "hit") for r in runs])
                                        for b in ("chance", "loo_prior", "train_prior"))
        out.append(f"| {f} | {n_pos} / {n_box} | {cell(zs)} | {cell([loc(r, 'attention', f, 'model', 'hit') for r in runs])}"
                   f" | {base('attention')} | {cell([loc(r, 'mask', f, 'model', 'hit') for r in runs])} | {base('mask')} | "
                   + " | ".join(cell([loc(r, "attention", f, "model", f"iobb_{t}") for r in runs]) for t in (0.1, 0.25, 0.5))
                   + f" | {cell([loc(r, 'attention', f, 'train_prior', 'iobb_0.1') for r in runs])} |")
    return out


if __name__ == "__main__":
    data = arms()
    lines = ["### Summary (NIH test: 62 images, 69 boxes)", ""] + summary_table(data) + [""]
    # every arm's PG − train-box prior pooled over its seeds, intervals over test images (and seeds)
    lines += margins_markdown({arm: pooled_margins([benchmark_hit_blocks(r) for r in runs]) for arm, runs in data.items()},
                              "### Pointing games − train-box prior (NIH test; paired per target, pooled over seeds)")
    for arm, runs in data.items():
        if runs:
            lines += per_finding(runs, arm) + [""]
    print("\n".join(lines))
