#!/usr/bin/env python
"""Apply a val probe's rule (configs/experiments/gpu-efficiency-probe.yaml) to its results.json.

    python scripts/probe_choice.py runs/experiments/gpu-efficiency-probe/efficiency/results.json [--margin 0.010]
    python scripts/probe_choice.py RESULTS --write-recipe runs/experiments/gpu-efficiency-probe/chosen-recipe.yaml

Each arm of the recipe the probe extends ("plain", "reinforced") and its alternatives ("plain-lr-0.001",
"reinforced-kl-only", ...: the arm's name, a dash, the change) are compared by their final mean R on the probe's
curve split (val): the best alternative replaces the arm's setting only if it ends above the arm's own by more than
``--margin`` (the rule's 0.010: the two plain seeds' spread at 400 steps). Prints one line per arm and, with
``--json``, the decision as JSON. Written before any probe ran, so the rule is applied as stated, not re-read.

``--write-recipe FILE`` also writes the recipe the report seeds then train: the probed recipe itself (its name and
folder, so its finished runs are reused) with each replaced setting laid over the arm's runs and those that share
its setting (plain's lr: plain-total-samples; reinforced's objective: the timed online arm). A run whose setting
changed has another config, so the recipe trains it anew (``reuse_runs``). ``--recipe`` names the probe's file
(default: gpu-efficiency-probe.yaml), where each alternative's setting is read.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import yaml

from cxrdr.common.configs import find_config
from cxrdr.experiments.recipe_file import load_recipe, recipe_out

# the runs that train with an arm's setting besides the arm's own
SHARES_SETTING = {"plain": ("plain-total-samples",), "reinforced": ("online",)}


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


def chosen_recipe(decided: dict, probe_path: Path) -> tuple[dict, str]:
    """(the recipe the probe's rule leaves: the recipe it extends, with each replaced setting laid over its arm's
    runs; a header saying so). The probe's alternatives' settings are read from its file."""
    probe = load_recipe(probe_path)
    if not probe.get("_extends"):
        raise SystemExit(f"{probe_path}: a probe extends the recipe it probes ('extends: ...'), this one does not")
    base_path = Path(probe["_extends"][0])
    base = load_recipe(base_path)
    try:  # a shipped recipe by its name, which any checkout or installed wheel resolves
        base_ref = base_path.stem if find_config(base_path.stem, "experiments").resolve() == base_path.resolve() \
            else str(base_path)
    except FileNotFoundError:
        base_ref = str(base_path)
    base_runs, probe_runs = base["efficiency"]["runs"], probe["efficiency"]["runs"]
    probed = {arm for arm in base_runs if any(name.startswith(arm + "-") for name in probe_runs)}
    if set(decided) != probed:  # a run that failed or went missing: the rule cannot compare its arm
        raise SystemExit(f"the probe's results decide {sorted(decided)}, its file probes {sorted(probed)}: each "
                         "probed arm and an alternative need a final val mean R for the rule to apply")
    runs, lines = {}, []
    for arm, d in decided.items():
        if not d["replace"]:
            lines.append(f"{arm}: kept ({arm} {d['current_value']:.3f}; best alternative {d['best']} "
                         f"{d['best_value']:.3f}, gain {d['gain']:+.3f} within the margin {d['margin']:.3f})")
            continue
        setting = {key: value for key, value in probe_runs[d["best"]].items() if key != "mode"}
        changed = [run for run in (arm, *SHARES_SETTING.get(arm, ())) if run in base_runs]
        runs.update({run: copy.deepcopy(setting) for run in changed})  # a copy each: no YAML anchors
        lines.append(f"{arm}: replaced by {d['best']} ({d['best_value']:.3f} against {d['current_value']:.3f}, gain "
                     f"{d['gain']:+.3f} past the margin {d['margin']:.3f}): {json.dumps(setting)} for "
                     + ", ".join(changed))
    recipe = {"extends": base_ref, "name": base["name"], "out": str(recipe_out(base))}
    if runs:
        recipe["efficiency"] = {"runs": runs}
    header = (f"# {base['name']} after its val probe ({probe_path.name}: seed 0, the students' val split; "
              f"scripts/probe_choice.py)\n" + "".join(f"#   {line}\n" for line in lines))
    return recipe, header


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--margin", type=float, default=0.010)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--recipe", type=Path, default=Path("configs/experiments/gpu-efficiency-probe.yaml"),
                        help="the probe's recipe file (its alternatives' settings)")
    parser.add_argument("--write-recipe", type=Path, help="write the recipe the rule leaves to this file")
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
    if args.write_recipe:
        recipe, header = chosen_recipe(decided, args.recipe)
        args.write_recipe.parent.mkdir(parents=True, exist_ok=True)
        args.write_recipe.write_text(header + yaml.safe_dump(recipe, sort_keys=False))
        print(f"wrote {args.write_recipe}: {recipe['name']} with "
              + (", ".join(f"{run} {json.dumps(s)}" for run, s in recipe["efficiency"]["runs"].items())
                 if "efficiency" in recipe else "no setting changed"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
