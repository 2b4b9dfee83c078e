#!/usr/bin/env python
"""The README's headline tables from the committed results (issue 28): the efficiency recipe and the A-E
ladder, each on its evaluation phantom over fresh seeds, mean ± 95 % CI beside chance and the strongest
image-blind baseline, every bar MET or MISSED as measured.

    python scripts/headline.py [docs/results/cpu-demo-efficiency.json] [docs/results/cpu-ladder.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cxrdr.experiments.stats import t_interval


def _ci(values) -> str:
    mean, half = t_interval(values or [])
    if mean is None:
        return "n/a"
    return f"{mean:.3f}" + (f" ± {half:.3f}" if half is not None else "")


def _num(v, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    return "never" if v == float("inf") else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _verdict(bar: dict) -> str:
    return {True: "**MET**", False: "**MISSED**"}.get(bar.get("met"), "not judged")


def _final(arm: dict, key: str) -> list:
    return (arm.get("final") or {}).get(f"{key}_seeds") or []


def efficiency(res: dict) -> list[str]:
    arms, cost = res["arms"], res.get("cost") or {}
    lines = [f"**Efficiency** (`train experiment efficiency --config configs/experiments/cpu-demo.yaml`; report "
             f"set `{res['protocol']['report_shards']}`; seeds {res['seeds']}, online and plain-more-data "
             f"on their own seed lists):", "",
             "| arm | seeds | mean R | same-findings R | probe AUC | samples to plain's final | ratio [95 %] |",
             "|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        c = arm.get("crossing") or {}
        ci = c.get("ratio_ci") or [None, None]
        lines.append(f"| {name} | {len(arm.get('final_mean_recall') or [])} | {_ci(arm.get('final_mean_recall'))} | "
                     f"{_ci(_final(arm, 'mean_recall_findings'))} | {_ci(_final(arm, 'probe_auc'))} | "
                     f"{_num(c.get('samples'), 0)} | {_num(c.get('ratio'))} [{_num(ci[0])}, {_num(ci[1])}] |")
    plain = arms.get("plain", {}).get("final") or {}
    lines += ["", f"Chance mean R {_num(plain.get('chance_mean_recall'))}; the findings oracle's strict mean R "
                  f"(its ceiling) {_num(plain.get('oracle_mean_recall'))}. The teacher trained on "
                  f"{cost.get('teacher_train_samples')} samples of images the students never see: with them the "
                  f"reinforced arm's samples ratio is {_num(cost.get('reinforced_ratio_with_teacher'))}.", ""]
    lines += [f"- {b['bar']}: {_num(b.get('value'))}" + (f" [{_num(b['ci'][0])}, {_num(b['ci'][1])}]"
                                                          if b.get("ci") else "") + f" — {_verdict(b)}"
              for b in res.get("bars") or []]
    return lines


def ladder(res: dict) -> list[str]:
    cols = [("mean_recall", "mean R"), ("chance_mean_recall", "chance"), ("pointing_z", "PG z"),
            ("train_prior_pointing_z", "z train prior"), ("chance_pointing_z", "z chance"),
            ("pointing_z_pathology", "PG z pathology"), ("pointing_attn", "PG attn"),
            ("train_prior_pointing_attn", "attn train prior"), ("chance_pointing_attn", "attn chance")]
    lines = [f"**A–E ladder** (`train experiment ablation --config configs/experiments/cpu-ladder.yaml`; report set "
             f"`{(res.get('protocol') or {}).get('report_shards')}`; seeds {res['seeds']}):", "",
             "| variant | " + " | ".join(h for _, h in cols) + " |", "|---|" + "---|" * len(cols)]
    for row in res["table"]:
        lines.append(f"| {row['run']} | " + " | ".join(_ci(row.get(f"{k}_seeds")) for k, _ in cols) + " |")
    lines += [""] + [f"- {b['bar']}: {_num(b.get('value'))} (limit {_num(b.get('limit'))}) — {_verdict(b)}"
                     for b in res.get("bars") or []]
    return lines


def main(argv: list[str]) -> None:
    eff = Path(argv[0] if argv else "docs/results/cpu-demo-efficiency.json")
    lad = Path(argv[1] if len(argv) > 1 else "docs/results/cpu-ladder.json")
    out = []
    if eff.is_file():
        out += efficiency(json.loads(eff.read_text())) + [""]
    if lad.is_file():
        out += ladder(json.loads(lad.read_text()))
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
