"""What an efficiency experiment has done and what is left (`train experiment efficiency --status`).

Lists every unit of work the experiment runs, in order (shard builds, each teacher's build, training,
evaluations and addition to the students' shards, the report set, each arm's runs and their evaluations,
the step benchmark with the results), each ``done``, ``partial`` (interrupted; the next command continues it)
or ``todo``, with what the finished ones measured: build and add-teacher seconds, a run's training seconds,
mean step and validation passes, an evaluation's seconds. Those are the figures the recipe's sizing is
re-checked against. Reads only: nothing is built, trained or locked.
"""
from __future__ import annotations

import json
from pathlib import Path

from cxrdr.experiments.carry import carried_from
from cxrdr.experiments.efficiency import arm_plan, runs_in_turn
from cxrdr.experiments.runs import (evaluation_done, evaluation_request, has_weights, logged_step, metrics_records,
                                   run_state)
from cxrdr.experiments.teacher_prep import teacher_eval_dir, teacher_eval_done, teacher_plans, teacher_seconds
from cxrdr.train.config import TrainConfig


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def _phases(seconds: dict) -> str:
    """"embed 5.6 s, retrieval 14.5 s": where a unit's time went ("" where it recorded none)."""
    return ", ".join(f"{phase} {float(s):.1f} s" for phase, s in seconds.items())


def _evaluation(eval_dir: Path) -> tuple[float | None, str]:
    """A finished evaluation's seconds and, where it recorded them, its phases'."""
    meta = (_json(eval_dir / "eval.json") or {}).get("meta") or {}
    return meta.get("eval_seconds"), _phases(meta.get("phase_s") or {})


def _unit(name: str, state: str, seconds: float | None = None, detail: str = "", kind: str = "setup") -> dict:
    """One unit of the listing; ``kind``: setup (shards, teachers), run (a run's training or evaluation; its folder
    under ``run``) or results (the step benchmark and the results)."""
    return {"unit": name, "state": state, "seconds": seconds, "detail": detail, "kind": kind}


def shard_unit(name: str, spec: dict) -> dict:
    out = Path(spec["dir"])
    info = _json(out / "dataset.json")
    if info is not None:
        build = info.get("build") or {}
        splits = ", ".join(f"{k} {v}" for k, v in (info.get("counts") or {}).items())
        return _unit(name, "done", build.get("wall_seconds"),
                     f"{info.get('total_samples')} samples ({splits}), {build.get('samples_per_second')} "
                     f"samples/s ({out})")
    shards = sorted((out / "stats").glob("*.json")) if (out / "stats").is_dir() else []
    return _unit(name, "partial" if shards else "todo", None, f"{len(shards)} shard(s) written ({out})")


def run_unit(name: str, cfg: TrainConfig, resume: bool) -> dict:
    run_dir = Path(cfg.out)
    state = run_state(run_dir, cfg)
    evals = metrics_records(run_dir)  # of a run a killed chunk may have left mid-write
    passes = [r for r in evals if r.get("kind") == "eval"]
    eval_s = sum(float(r.get("eval_time_s") or 0) for r in passes)
    phases: dict[str, float] = {}  # where the passes spent it (the loop's eval_phase_s)
    for record in passes:
        for phase, seconds in (record.get("eval_phase_s") or {}).items():
            phases[phase] = phases.get(phase, 0.0) + float(seconds)
    split = f" ({_phases(phases)})" if phases else ""
    if state == "done":
        summary = _json(run_dir / "summary.json") or {}
        train_s = summary.get("train_time_s")
        carried = carried_from(run_dir)
        where = f" (carried from {carried.get('from')!r})" if carried else ""
        return _unit(name, "done", None if train_s is None else float(train_s) + eval_s,
                     f"{summary.get('steps')} steps x {cfg.batch_size * cfg.accum_steps}: training "
                     f"{train_s} s, mean step {summary.get('mean_step_ms')} ms; {len(passes)} validation "
                     f"passes {eval_s:.1f} s{split}{where}")
    if state == "partial":
        step = logged_step(evals)
        how = "the next command continues it" if resume else "restarts: the recipe does not set resume_runs"
        return _unit(name, "partial", None, f"interrupted near step {step} of {cfg.steps} ({how})")
    return _unit(name, "todo", None, f"{cfg.steps} steps x {cfg.batch_size * cfg.accum_steps} ({cfg.mode})")


def efficiency_status(recipe: dict, out_dir: Path) -> list[dict]:
    """Every unit of ``train experiment efficiency`` for ``recipe`` with results in ``out_dir``."""
    resume = bool(recipe.get("resume_runs", False))
    shards = Path(recipe["shards"]["dir"])
    units = [shard_unit("students' shards", recipe["shards"])]
    if (recipe.get("report") or {}).get("shards"):
        units.append(shard_unit("report set", recipe["report"]["shards"]))
    info = _json(shards / "dataset.json") or {}
    stored = {t["name"] for t in info.get("teachers", [])}
    for name, plan in teacher_plans(recipe, "efficiency").items():
        run_dir = Path(plan["cfg"].out)
        units.append(shard_unit(f"teacher {name}: its shards", plan["shards"]))
        units.append(run_unit(f"teacher {name}: training", plan["cfg"], resume))
        for tag in plan["evaluate"]:
            done = (run_dir / "last.pt").is_file() and teacher_eval_done(run_dir, tag)
            seconds, phases = _evaluation(teacher_eval_dir(run_dir, tag)) if done else (None, "")
            units.append(_unit(f"teacher {name}: evaluation on {tag}", "done" if done else "todo", seconds, phases))
        added = plan["shard_name"] in stored
        units.append(_unit(f"teacher {name}: added to the students' shards", "done" if added else "todo",
                           teacher_seconds(info, [plan["shard_name"]]) if added else None))
    arm_runs, options, timed_only = arm_plan(recipe, shards, out_dir, build=False)
    for name, opts in options.items():
        if opts.get("shards") and name not in timed_only:
            units.append(shard_unit(f"{name}: its own shards", opts["shards"]))
    isolated = recipe.get("isolated_efficiency", False)
    eval_files = []
    for name, seed, cfg, first in runs_in_turn(arm_runs):  # in the order the runs are trained
        run_dir = Path(cfg.out)
        units.append({**run_unit(f"{name} seed {seed}: training", cfg, resume), "kind": "run", "run": run_dir})
        done = has_weights(run_dir) and evaluation_done(recipe, run_dir, shards, isolated, efficiency=first)
        eval_dir = evaluation_request(recipe, run_dir, shards, isolated, build=False)[0]
        eval_files.append(eval_dir / "eval.json")
        seconds, phases = _evaluation(eval_dir) if done else (None, "")
        units.append({**_unit(f"{name} seed {seed}: evaluation", "done" if done else "todo", seconds, phases,
                              kind="run"), "run": run_dir})
    results = out_dir / "results.json"
    fresh = results.is_file() and all(u["state"] == "done" for u in units) and all(
        f.is_file() and f.stat().st_mtime <= results.stat().st_mtime for f in eval_files)
    timed = f" (timed only: {', '.join(sorted(timed_only))})" if timed_only else ""
    units.append(_unit("step benchmark, results.json, table.md, plots", "done" if fresh else "todo", None,
                       f"{out_dir}{timed}", kind="results"))
    return units


def left(units: list[dict]) -> int:
    return sum(u["state"] != "done" for u in units)


def format_status(recipe: dict, out_dir: Path, units: list[dict]) -> str:
    done = len(units) - left(units)
    measured = sum(u["seconds"] or 0 for u in units if u["state"] == "done")
    lines = [f"[status] {recipe.get('name')} -> {out_dir}: {done} of {len(units)} units done, {left(units)} left"]
    for u in units:
        seconds = f"{u['seconds']:8.1f} s" if u["seconds"] is not None else " " * 10
        lines.append(f"  {u['state']:<8} {u['unit']:<52} {seconds}  {u['detail']}".rstrip())
    lines.append(f"[status] measured work of the done units: {measured:.0f} s (builds, training with its validation "
                 f"passes, evaluations, add-teacher; without start-up and work lost to interruptions)")
    return "\n".join(lines)
