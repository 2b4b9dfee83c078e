"""`train experiment efficiency`: plain vs reinforced vs online teacher, same samples seen, over seeds.

Every arm (``efficiency.runs``: plain = CLIP only with fresh augmentations; reinforced = stored teacher
embeddings of the stored views; online = the teacher run inside the loop on the same crops) is trained
once per seed in ``efficiency.seeds``. Outputs (``<out>/efficiency/``):

- ``results.json``: per arm ``final_mean_recall`` (list over seeds, test split, full ``train eval``),
  ``samples_to_plain_final`` (samples at which the arm's seed-mean validation curve first reaches plain's
  final seed-mean validation mean R, linearly interpolated; null if never), per-seed curves and rows,
  the cost accounting (one-off teacher seconds, per-run saving, break-even runs) and the bars;
- ``table.md``: mean ± 95 % CI (t-interval over seeds) with chance next to mean R, samples-to-target,
  step costs (interleaved measurement), break-even line, bars met/missed;
- ``metric_vs_samples.png`` / ``auc_vs_samples.png`` (seed-mean curves with 95 % CI bands), ``step_time.png``.

Teachers named in the recipe's ``teachers`` key are trained and added to the shards first
(cxrdr/experiments/teacher_prep.py).
"""
from __future__ import annotations

import json
import time
from fractions import Fraction
from pathlib import Path

import torch
import typer

from cxrdr.experiments.efficiency_report import BENCHMARK_COLS, QUALITY, efficiency_markdown, plot_efficiency
from cxrdr.experiments.recipe import recipe_seeds, set_threads, train_config
from cxrdr.experiments.runs import ensure_shards, eval_curve, evaluate_run, result_row, run_training
from cxrdr.experiments.stats import mean_curve, mean_sd, samples_to_target, t_interval
from cxrdr.experiments.teacher_prep import prepare_teachers, teacher_seconds
from cxrdr.train.evaluation.report import seed_summary, write_json
from cxrdr.train.loop import Trainer

DEFAULT_RUNS = {"plain": {"mode": "plain"}, "reinforced": {"mode": "reinforced"}}
DEFAULT_METRIC = "mean_recall"


def metrics_of(spec: dict) -> tuple[str, str, float]:
    """(curve metric of the validation passes, final test metric of the row, samples bar's fraction of plain's
    samples): ``efficiency.metric`` (default mean_recall), ``efficiency.final_metric`` (default the curve's),
    ``efficiency.samples_fraction`` (default 1/3)."""
    curve = spec.get("metric", DEFAULT_METRIC)
    return curve, spec.get("final_metric", curve), float(spec.get("samples_fraction", 1 / 3))


# --------------------------------------------------------------------------- runs


def _train_arm(recipe: dict, shards: Path, out_dir: Path, name: str, overrides: dict, seeds: list[int]) -> dict:
    spec = recipe.get("efficiency") or {}
    every = spec.get("eval_every_samples")
    curve_split = spec.get("curve_split", "test")
    seed_rows, records = [], []
    for seed in seeds:
        run_dir = out_dir / "runs" / name / f"seed-{seed}"
        base = train_config(recipe, shards, run_dir, overrides, "efficiency")
        per_step = base.batch_size * base.accum_steps
        eval_every = max(1, round(every / per_step)) if every else 0
        cfg = train_config(recipe, shards, run_dir, {"eval_every": eval_every, "eval_split": curve_split,
                                                     "seed": int(seed), **overrides}, "efficiency")
        typer.echo(f"[efficiency] {name} seed {seed}: {cfg.steps} steps x {per_step} samples (mode {cfg.mode}, "
                   f"online teacher {cfg.online_teacher})", err=True)
        summary = run_training(cfg, recipe.get("reuse_runs", True))
        results = evaluate_run(recipe, run_dir, shards, recipe.get("isolated_efficiency", False),
                               efficiency=seed == seeds[0])  # cost is the architecture's: one seed
        seed_rows.append(result_row(name, summary, results, per_step))
        records.append({"seed": int(seed), "train_config": cfg.to_dict(), "train_summary": summary,
                        "curve": eval_curve(run_dir, per_step), "final": results["summary"]})
    return {"rows": seed_rows, "seeds": records}


def _arm_row(name: str, arm: dict, final_metric: str = DEFAULT_METRIC) -> dict:
    quality = QUALITY + [c for c in dict.fromkeys((final_metric,) + BENCHMARK_COLS) if c not in QUALITY
                         and any(c in r for r in arm["rows"])]
    row = seed_summary(name, arm["rows"], quality + ["samples_seen", "wall_s", "step_ms"])
    for col in quality:
        row[f"{col}_ci"] = t_interval(row[f"{col}_seeds"])[1]
    return row


def _step_benchmark(recipe: dict, shards: Path, out_dir: Path, runs: dict, seed: int) -> dict:
    bench = (recipe.get("efficiency") or {}).get("step_benchmark", {"steps": 10, "warmup": 2})
    if not bench or not bench.get("steps"):
        return {}
    typer.echo(f"[efficiency] interleaved step benchmark: {bench['steps']} steps per arm", err=True)
    cfgs = {r: train_config(recipe, shards, out_dir / "step-benchmark" / r,
                            # scratch folders: a re-run of the experiment measures afresh over them
                            dict(runs[r] or {}, steps=10**6, eval_every=0, progress=False, seed=seed,
                                 overwrite=True),
                            "efficiency") for r in runs}
    return interleaved_step_ms(cfgs, int(bench["steps"]), int(bench.get("warmup", 2)))


def interleaved_step_ms(cfgs: dict, steps: int = 10, warmup: int = 2) -> dict:
    """Median ms per optimiser step of each training config, steps interleaved round-robin.

    The runs' own mean step time depends on whatever else the machine did meanwhile; here every
    config takes one step in turn, so all see the same background load and the ratios hold.
    Uses the loop's Trainer (data loading + online teacher + forward + losses + backward + AdamW).
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    trainers = {}
    for name, cfg in cfgs.items():
        trainer = Trainer(cfg)
        trainers[name] = (trainer, trainer._batches())
    times: dict = {name: [] for name in trainers}
    for round_ in range(warmup + steps):
        for name, (trainer, batches) in trainers.items():
            sync()
            t0 = time.perf_counter()
            trainer.train_step(batches, log_balance=False)
            sync()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * sorted(t)[len(t) // 2] for name, t in times.items()}


# --------------------------------------------------------------------------- accounting


def one_off_teacher_seconds(info: dict, names: list[str]) -> dict:
    """Seconds the shards spent embedding with ``names``: their add-teacher passes, plus the build's
    teacher seconds when one of them was a build teacher (the build runs its teachers together)."""
    added = {n for a in info.get("teacher_additions") or [] for n in a.get("teachers", [])}
    built = [n for n in names if n not in added]
    build_split = ((info.get("build") or {}).get("time_split_seconds") or {})
    build_s = float(build_split.get("teacher") or 0.0) if built else 0.0
    add_s = teacher_seconds(info, [n for n in names if n in added]) or 0.0
    return {"teachers": names, "build_teacher_s": build_s, "add_teacher_s": add_s, "total_s": build_s + add_s,
            "build_samples_per_s": (info.get("build") or {}).get("samples_per_second")}


def break_even(one_off_s: float, online_ms: float | None, stored_ms: float | None, steps: int) -> dict:
    """Training runs after which storing the embeddings has paid for itself."""
    if online_ms is None or stored_ms is None:
        return {"saving_per_run_s": None, "break_even_runs": None}
    saving = (online_ms - stored_ms) / 1000.0 * steps
    return {"saving_per_run_s": saving, "online_step_ms": online_ms, "stored_step_ms": stored_ms, "steps": steps,
            "break_even_runs": one_off_s / saving if saving > 0 else None}


def _label(metric: str) -> str:
    return "mean R" if metric == "mean_recall" else metric


def samples_limit(plain_total: float, fraction: float = 1 / 3) -> float:
    """The first bar's limit: reinforced reaches plain's final within ``fraction`` of plain's samples."""
    return plain_total * fraction


def bars(arms: dict, bench: dict, plain_total: float, curve: str = DEFAULT_METRIC, final: str = DEFAULT_METRIC,
         fraction: float = 1 / 3) -> list[dict]:
    """The issue-10 bars, measured: met True/False, None where a figure is missing."""
    out = []
    rein, plain = arms.get("reinforced"), arms.get("plain")
    if rein and plain:
        s, limit = rein["samples_to_plain_final"], samples_limit(plain_total, fraction)
        share = Fraction(fraction).limit_denominator(10)
        out.append({"bar": f"reinforced reaches plain's final {_label(curve)} with <= {share} of plain's samples",
                    "value": s, "limit": limit, "met": None if s is None else s <= limit})
        p_mean, p_sd = mean_sd(plain[f"final_{final}"])
        r_mean, _ = mean_sd(rein[f"final_{final}"])
        gap = None if r_mean is None or p_mean is None else r_mean - p_mean
        out.append({"bar": f"reinforced final {_label(final)} - plain's > 2 sd of plain's seeds", "value": gap,
                    "limit": None if p_sd is None else 2 * p_sd,
                    "met": None if gap is None or p_sd is None else gap > 2 * p_sd})
    ratios = (("stored step <= 1.05x no-teacher step", "reinforced", "plain", lambda r: r <= 1.05),
              ("online step >= 3x stored step", "online", "reinforced", lambda r: r >= 3.0))
    for text, a, b, ok in ratios:
        r = bench[a] / bench[b] if bench.get(a) and bench.get(b) else None
        out.append({"bar": text, "value": r, "met": None if r is None else ok(r)})
    return out


# --------------------------------------------------------------------------- experiment


def efficiency_experiment(recipe: dict, out_dir: Path, progress: bool = True) -> dict:
    set_threads(recipe)
    shards = ensure_shards(recipe["shards"], progress)
    teachers = prepare_teachers(recipe, shards, progress, experiment="efficiency")
    spec = recipe.get("efficiency") or {}
    runs = {k: dict(v or {}) for k, v in (spec.get("runs") or DEFAULT_RUNS).items()}
    seeds = recipe_seeds(recipe, spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    # a run may name its own seeds (a subset), e.g. an online arm whose teacher-in-the-loop steps do not fit
    # an arm marked step_benchmark_only is not trained, only timed (e.g. the teacher in the loop, whose cost
    # is what the break-even needs, where training it over seeds does not fit the budget)
    timed_only = {name for name, o in runs.items() if o.pop("step_benchmark_only", False)}
    trained = {name: _train_arm(recipe, shards, out_dir, name, overrides, _arm_seeds(overrides, seeds))
               for name, overrides in runs.items() if name not in timed_only}
    runs = {name: {k: v for k, v in o.items() if k != "seeds"} for name, o in runs.items()}
    bench = _step_benchmark(recipe, shards, out_dir, runs, seeds[0])
    curve_metric, final_metric, fraction = metrics_of(spec)
    arms, rows = _summarise_arms(trained, bench, curve_metric, final_metric)
    rows += [{"run": name, "bench_step_ms": bench.get(name), "note": "step benchmark only"} for name in timed_only]
    info = json.loads((shards / "dataset.json").read_text())
    steps = trained[next(iter(trained))]["seeds"][0]["train_config"]["steps"]
    used = _stored_teachers(trained, info)
    cost = one_off_teacher_seconds(info, used)
    cost.update(break_even(cost["total_s"], bench.get("online"), bench.get("reinforced"), steps))
    plain_total = max((r["samples_seen"] or 0) for r in trained.get("plain", trained[next(iter(trained))])["rows"])
    measured_bars = bars(arms, bench, plain_total, curve_metric, final_metric, fraction)
    result = {"experiment": "efficiency", "recipe": recipe, "shards": str(shards), "seeds": seeds,
              "curve_metric": curve_metric, "final_metric": final_metric,
              "curve_split": spec.get("curve_split", "test"), "teachers": teachers, "arms": arms,
              "bench_step_ms": bench, "cost": cost, "bars": measured_bars, "table": rows,
              "runs": {n: t["seeds"] for n, t in trained.items()}}
    write_json(result, out_dir / "results.json")
    plot_efficiency(arms, bench, rows, spec.get("curve_split", "test"), out_dir,
                    samples_limit(plain_total, fraction), curve_metric,
                    f"{Fraction(fraction).limit_denominator(10)} of plain's samples")
    md = efficiency_markdown(recipe, shards, seeds, rows, teachers, cost, measured_bars, arms, curve_metric,
                             final_metric)
    (out_dir / "table.md").write_text("\n".join(md))
    typer.echo("\n".join(md))
    return result


def _arm_seeds(overrides: dict, seeds: list[int]) -> list[int]:
    own = overrides.pop("seeds", None)
    return [int(s) for s in own] if own else seeds


def _stored_teachers(trained: dict, info: dict) -> list[str]:
    """Shard teachers the reinforced arm read (its ``teachers`` subset, else all of them)."""
    names = [t["name"] for t in info.get("teachers", [])]
    rein = trained.get("reinforced")
    subset = rein["seeds"][0]["train_config"].get("teachers") if rein else None
    return [n.strip() for n in subset.split(",")] if subset else names


def _summarise_arms(trained: dict, bench: dict, metric: str = DEFAULT_METRIC,
                    final_metric: str = DEFAULT_METRIC) -> tuple[dict, list[dict]]:
    curves = {n: mean_curve([s["curve"] for s in t["seeds"]], metric) for n, t in trained.items()}
    plain = curves.get("plain")
    target = plain["mean"][-1] if plain and plain["mean"] else None
    arms, rows = {}, []
    for name, t in trained.items():
        row = _arm_row(name, t, final_metric)
        c = curves[name]
        reach = samples_to_target(c["xs"], c["mean"], target) if target is not None else None
        per_seed = [samples_to_target([p["samples_seen"] for p in s["curve"]],
                                      [p[metric] for p in s["curve"]], target) if target is not None else None
                    for s in t["seeds"]]
        row.update(samples_to_plain_final=reach, bench_step_ms=bench.get(name))
        rows.append(row)
        arms[name] = {f"final_{final_metric}": row[f"{final_metric}_seeds"], "samples_to_plain_final": reach,
                      "final_metric": final_metric, "curve_metric": metric,
                      "curve_probe_mean_auc": mean_curve([s["curve"] for s in t["seeds"]], "probe_mean_auc"),
                      "samples_to_plain_final_per_seed": per_seed, "plain_final_target": target,
                      "chance_mean_recall": row.get("chance_mean_recall"), "curve_mean": c,
                      "final": {k: row.get(k) for k in row if not k.startswith("run")}}
    return arms, rows


