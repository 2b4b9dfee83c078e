#!/usr/bin/env python
"""Apply a val probe's rule (configs/experiments/gpu-efficiency-probe.yaml) to its results.json.

    python scripts/probe_choice.py runs/experiments/gpu-efficiency-probe/efficiency/results.json [--margin 0.010]

Each arm of the recipe the probe extends ("plain", "reinforced") and its alternatives ("plain-lr-0.001",
"reinforced-kl-only", ...: the arm's name, a dash, the change) are compared by their final mean R on the probe's
curve split (val): the best alternative replaces the arm's setting only if it ends above the arm's own by more than
``--margin`` (the rule's 0.010: the two plain seeds' spread at 400 steps). Prints one line per arm and, with
``--json``, the decision as JSON. Written before any probe ran, so the rule is applied as stated, not re-read.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def choices(results: dict, margin: float) -> dict:
    """arm -> {current, best, best_value, margin, replace, values}: the rule applied to each arm that has
    alternatives in the probe (its runs named ``<arm>-<change>``)."""
    split = results.get("curve_split")
    if split != "val":
        raise SystemExit(f"these results read curve split {split!r}: a probe's choices read val only")
    final = {row["run"]: row["mean_recall"] for row in results["table"] if row.get("mean_recall") is not None}
    out = {}
    for arm in sorted(a for a in final if not any(a.startswith(b + "-") for b in final if b != a)):
        family = {name: value for name, value in final.items() if name == arm or name.startswith(arm + "-")}
        if len(family) < 2:
            continue
        best = max(family, key=family.get)
        gain = family[best] - family[arm]
        out[arm] = {"current": arm, "current_value": family[arm], "best": best, "best_value": family[best],
                    "gain": gain, "margin": margin, "replace": best != arm and gain > margin, "values": family}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--margin", type=float, default=0.010)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    decided = choices(json.loads(args.results.read_text()), args.margin)
    if not decided:
        raise SystemExit(f"{args.results}: no arm has alternatives (runs named <arm>-<change>)")
    for arm, d in decided.items():
        verdict = f"replace with {d['best']}" if d["replace"] else "keep"
        print(f"{arm}: {verdict} (final val mean R {d['current_value']:.3f}; best {d['best']} {d['best_value']:.3f}, "
              f"gain {d['gain']:+.3f} against the margin {d['margin']:.3f}; "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(d["values"].items(), key=lambda kv: -kv[1])) + ")")
    if args.json:
        json.dump(decided, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
