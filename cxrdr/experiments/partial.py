"""``train experiment efficiency --partial``: the results of the runs a chunked recipe has finished so far.

A lent GPU comes for a few minutes a session and its disk is wiped after (docs/gpu.md): a recipe that does not
finish in one lease would leave nothing to read. This writes to OUT/partial/ the efficiency tables, bars and plots
over each arm's runs that are trained and evaluated (the arms' seeds are trained in turn, so those are paired:
``efficiency.runs_in_turn``). It only reads: every unit before the runs (shards, teachers) must be done, the recipe
is read with every reuse on and no shard folder rebuilt (``read_only``), only finished runs are passed on, and
no step is timed (the step benchmark's figures stay empty). While runs are left the figures rest on fewer seeds
than the recipe names; the table's first line and the JSON's ``partial`` say which.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from cxrdr.common.errors import UserError
from cxrdr.experiments.efficiency import _results, _train_arms, arm_plan
from cxrdr.experiments.partial_note import partial_caveat, seeds_by_arm
from cxrdr.experiments.status import efficiency_status
from cxrdr.experiments.teacher_prep import prepare_teachers


def read_only(recipe: dict) -> dict:
    """``recipe`` with finished runs and evaluations reused (``reuse_runs``) and no shard folder rebuilt
    (``rebuild`` off wherever it is set): with every unit done, running it reads and trains nothing anew."""
    def off(value):
        if isinstance(value, dict):
            return {k: (False if k == "rebuild" else off(v)) for k, v in value.items()}
        return [off(v) for v in value] if isinstance(value, list) else value
    return {**off(recipe), "reuse_runs": True}


def finished_runs(units: list[dict]) -> set[Path]:
    """The run folders whose training and evaluation units (``status.efficiency_status``) are both done."""
    states: dict[Path, set[str]] = {}
    for unit in units:
        if unit["kind"] == "run":
            states.setdefault(unit["run"], set()).add(unit["state"])
    return {run for run, seen in states.items() if seen == {"done"}}


def partial_results(recipe: dict, out_dir: Path) -> dict:
    """results.json, table.md and the plots of the finished runs, in ``out_dir``/partial (module docstring); an
    earlier partial report there is removed first, so a refused one leaves none behind."""
    shutil.rmtree(out_dir / "partial", ignore_errors=True)
    recipe = read_only(recipe)
    units = efficiency_status(recipe, out_dir)
    missing = [u["unit"] for u in units if u["kind"] == "setup" and u["state"] != "done"]
    if missing:
        raise UserError(f"no partial results yet: {missing[0]!r} is not done ({len(missing)} unit(s) before the "
                        "runs are left); run the experiment further first")
    shards = Path(recipe["shards"]["dir"])
    arm_runs, runs, _ = arm_plan(recipe, shards, out_dir, build=False)
    finished = finished_runs(units)
    if not finished:
        raise UserError("no partial results yet: no run is trained and evaluated")
    teachers = prepare_teachers(recipe, lambda: shards, progress=False, experiment="efficiency")  # all done: reused
    trained = _train_arms(recipe, shards, arm_runs, only=finished)  # finished runs only: each reused as it is
    spec = dict(recipe.get("efficiency") or {})
    spec["comparisons"] = [p for p in spec.get("comparisons") or [] if all(a in trained for a in p)]
    done = {name: [r["seed"] for r in t["seeds"]] for name, t in trained.items()}
    planned = {name: [seed for seed, _ in rs] for name, rs in arm_runs.items()}
    left = {name: [s for s in seeds if s not in done.get(name, [])] for name, seeds in planned.items()}
    left = {n: s for n, s in left.items() if s}
    note = (f"{len(finished)} of {sum(map(len, planned.values()))} runs finished ("
            + seeds_by_arm({name: done.get(name, []) for name in planned}) + "); no step benchmark. "
            + partial_caveat(left))
    partial = {"note": note, "finished": done, "left": left}
    seeds = sorted({s for seeds in done.values() for s in seeds})
    # the arms that are only timed (online) have no row without the step benchmark
    return _results(recipe, out_dir / "partial", shards, teachers, spec, seeds, trained, runs, [], partial)
