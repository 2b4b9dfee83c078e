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
(train/teacher_prep.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import typer

QUALITY = ["i2t_R@1", "t2i_R@1", "mean_recall", "chance_mean_recall", "probe_auc", "zeroshot_auc"]
TABLE_COLS = ["n_seeds"] + QUALITY + ["samples_to_plain_final", "samples_seen", "wall_s", "step_ms", "bench_step_ms"]


# --------------------------------------------------------------------------- statistics


def t_interval(values: list[float], confidence: float = 0.95) -> tuple[float | None, float | None]:
    """(mean, half-width of the two-sided t-interval of the mean); half-width None below 2 values."""
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    from scipy.stats import t

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, float(t.ppf(0.5 + confidence / 2, len(values) - 1)) * sd / math.sqrt(len(values))


def samples_to_target(xs: list[float], ys: list[float], target: float) -> float | None:
    """First samples count at which the curve (xs ascending) reaches ``target``, interpolated linearly
    between the two evaluations around the crossing. Reached at the first evaluation already: that
    evaluation's x (nothing was measured before it, so it is an upper bound). Never reached: None."""
    prev = None
    for x, y in zip(xs, ys):
        if y is None:
            continue
        if y >= target:
            if prev is None:
                return float(x)
            (x0, y0) = prev
            return float(x0 + (x - x0) * (target - y0) / (y - y0)) if y != y0 else float(x)
        prev = (x, y)
    return None


def mean_curve(curves: list[list[dict]], metric: str = "mean_recall") -> dict:
    """Seed-mean curve on the samples points every seed evaluated: {xs, mean, ci}."""
    common = sorted(set.intersection(*[{p["samples_seen"] for p in c} for c in curves])) if curves else []
    means, cis = [], []
    for x in common:
        values = [next(p[metric] for p in c if p["samples_seen"] == x) for c in curves]
        m, h = t_interval([v for v in values if v is not None])
        means.append(m)
        cis.append(h)
    return {"xs": common, "mean": means, "ci": cis}


# --------------------------------------------------------------------------- runs


def _train_arm(recipe: dict, shards: Path, out_dir: Path, name: str, overrides: dict, seeds: list[int],
               progress_note: str) -> dict:
    from cxrdr.experiments.recipes import _row, eval_curve, evaluate_run, run_training, train_config

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
                   f"online teacher {cfg.online_teacher}){progress_note}", err=True)
        summary = run_training(cfg, recipe.get("reuse_runs", True))
        results = evaluate_run(recipe, run_dir, shards, recipe.get("isolated_efficiency", False),
                               efficiency=seed == seeds[0])  # cost is the architecture's: one seed
        seed_rows.append(_row(name, summary, results, per_step))
        records.append({"seed": int(seed), "train_config": cfg.to_dict(), "train_summary": summary,
                        "curve": eval_curve(run_dir, per_step), "final": results["summary"]})
    return {"rows": seed_rows, "seeds": records}


def _arm_row(name: str, arm: dict) -> dict:
    from cxrdr.train.evaluation.report import seed_summary

    row = seed_summary(name, arm["rows"], QUALITY + ["samples_seen", "wall_s", "step_ms"])
    for col in QUALITY:
        row[f"{col}_ci"] = t_interval(row[f"{col}_seeds"])[1]
    return row


def _step_benchmark(recipe: dict, shards: Path, out_dir: Path, runs: dict, seed: int) -> dict:
    from cxrdr.experiments.recipes import interleaved_step_ms, train_config

    bench = (recipe.get("efficiency") or {}).get("step_benchmark", {"steps": 10, "warmup": 2})
    if not bench or not bench.get("steps"):
        return {}
    typer.echo(f"[efficiency] interleaved step benchmark: {bench['steps']} steps per arm", err=True)
    cfgs = {r: train_config(recipe, shards, out_dir / "step-benchmark" / r,
                            dict(runs[r] or {}, steps=10**6, eval_every=0, progress=False, seed=seed),
                            "efficiency") for r in runs}
    return interleaved_step_ms(cfgs, int(bench["steps"]), int(bench.get("warmup", 2)))


# --------------------------------------------------------------------------- accounting


def one_off_teacher_seconds(info: dict, names: list[str]) -> dict:
    """Seconds the shards spent embedding with ``names``: their add-teacher passes, plus the build's
    teacher seconds when one of them was a build teacher (the build runs its teachers together)."""
    from cxrdr.experiments.teacher_prep import teacher_seconds

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


def bars(arms: dict, bench: dict, plain_total: float) -> list[dict]:
    """The issue-10 bars, measured: met True/False, None where a figure is missing."""
    out = []
    rein, plain = arms.get("reinforced"), arms.get("plain")
    if rein and plain:
        s = rein["samples_to_plain_final"]
        out.append({"bar": "reinforced reaches plain's final mean R with <= 1/3 of plain's samples",
                    "value": s, "limit": plain_total / 3, "met": None if s is None else s <= plain_total / 3})
        p_mean, p_sd = _mean_sd(plain["final_mean_recall"])
        r_mean, _ = _mean_sd(rein["final_mean_recall"])
        gap = None if r_mean is None or p_mean is None else r_mean - p_mean
        out.append({"bar": "reinforced final mean R - plain's > 2 sd of plain's seeds", "value": gap,
                    "limit": None if p_sd is None else 2 * p_sd,
                    "met": None if gap is None or p_sd is None else gap > 2 * p_sd})
    ratios = (("stored step <= 1.05x no-teacher step", "reinforced", "plain", lambda r: r <= 1.05),
              ("online step >= 3x stored step", "online", "reinforced", lambda r: r >= 3.0))
    for text, a, b, ok in ratios:
        r = bench[a] / bench[b] if bench.get(a) and bench.get(b) else None
        out.append({"bar": text, "value": r, "met": None if r is None else ok(r)})
    return out


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, sd


# --------------------------------------------------------------------------- experiment


def efficiency_experiment(recipe: dict, out_dir: Path, progress: bool = True) -> dict:
    from cxrdr.train.evaluation.report import write_json
    from cxrdr.experiments.recipes import DEFAULT_EFFICIENCY_RUNS, _set_threads, ensure_shards
    from cxrdr.experiments.teacher_prep import prepare_teachers

    _set_threads(recipe)
    shards = ensure_shards(recipe["shards"], progress)
    teachers = prepare_teachers(recipe, shards, progress, experiment="efficiency")
    spec = recipe.get("efficiency") or {}
    runs = {k: dict(v or {}) for k, v in (spec.get("runs") or DEFAULT_EFFICIENCY_RUNS).items()}
    seeds = [int(s) for s in spec.get("seeds") or [int((recipe.get("train") or {}).get("seed", 0))]]
    out_dir.mkdir(parents=True, exist_ok=True)
    # a run may name its own seeds (a subset), e.g. an online arm whose teacher-in-the-loop steps do not fit
    trained = {name: _train_arm(recipe, shards, out_dir, name, overrides, _arm_seeds(overrides, seeds), "")
               for name, overrides in runs.items()}
    runs = {name: {k: v for k, v in o.items() if k != "seeds"} for name, o in runs.items()}
    bench = _step_benchmark(recipe, shards, out_dir, runs, seeds[0])
    arms, rows = _summarise_arms(trained, bench)
    info = json.loads((shards / "dataset.json").read_text())
    steps = trained[next(iter(trained))]["seeds"][0]["train_config"]["steps"]
    used = _stored_teachers(trained, info)
    cost = {**one_off_teacher_seconds(info, used)}
    cost.update(break_even(cost["total_s"], bench.get("online"), bench.get("reinforced"), steps))
    plain_total = max((r["samples_seen"] or 0) for r in trained.get("plain", trained[next(iter(trained))])["rows"])
    measured_bars = bars(arms, bench, plain_total)
    result = {"experiment": "efficiency", "recipe": recipe, "shards": str(shards), "seeds": seeds,
              "curve_split": spec.get("curve_split", "test"), "teachers": teachers, "arms": arms,
              "bench_step_ms": bench, "cost": cost, "bars": measured_bars, "table": rows,
              "runs": {n: t["seeds"] for n, t in trained.items()}}
    write_json(result, out_dir / "results.json")
    _plots(arms, bench, rows, spec.get("curve_split", "test"), out_dir)
    md = efficiency_markdown(recipe, shards, seeds, rows, teachers, cost, measured_bars, arms)
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


def _summarise_arms(trained: dict, bench: dict) -> tuple[dict, list[dict]]:
    curves = {n: mean_curve([s["curve"] for s in t["seeds"]]) for n, t in trained.items()}
    plain = curves.get("plain")
    target = plain["mean"][-1] if plain and plain["mean"] else None
    arms, rows = {}, []
    for name, t in trained.items():
        row = _arm_row(name, t)
        c = curves[name]
        reach = samples_to_target(c["xs"], c["mean"], target) if target is not None else None
        per_seed = [samples_to_target([p["samples_seen"] for p in s["curve"]],
                                      [p["mean_recall"] for p in s["curve"]], target) if target is not None else None
                    for s in t["seeds"]]
        row.update(samples_to_plain_final=reach, bench_step_ms=bench.get(name))
        rows.append(row)
        arms[name] = {"final_mean_recall": row["mean_recall_seeds"], "samples_to_plain_final": reach,
                      "curve_probe_mean_auc": mean_curve([s["curve"] for s in t["seeds"]], "probe_mean_auc"),
                      "samples_to_plain_final_per_seed": per_seed, "plain_final_target": target,
                      "chance_mean_recall": row.get("chance_mean_recall"), "curve_mean": c,
                      "final": {k: row.get(k) for k in row if not k.startswith("run")}}
    return arms, rows


def _plots(arms: dict, bench: dict, rows: list[dict], curve_split: str, out_dir: Path) -> None:
    from cxrdr.train.evaluation.report import plot_bars

    for metric, ylabel, path in (("mean_recall", f"mean recall ({curve_split})", "metric_vs_samples.png"),
                                 ("probe_mean_auc", f"probe AUC ({curve_split}, half-subject)", "auc_vs_samples.png")):
        plot_bands(arms, metric, ylabel, out_dir / path)
    plot_bars({r["run"]: r.get("bench_step_ms") or r["step_ms"] for r in rows}, "ms / step",
              "training step time (interleaved median)" if bench else "training step time (run mean)",
              out_dir / "step_time.png")


def plot_bands(arms: dict, metric: str, ylabel: str, path: Path) -> None:
    """Seed-mean validation curve per arm with its 95 % t-interval band; plain's final mean as a line."""
    from cxrdr.train.evaluation.report import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    for name, arm in arms.items():
        c = arm["curve_mean"] if metric == "mean_recall" else arm.get(f"curve_{metric}") or {}
        if not c.get("xs"):
            continue
        ys = [float("nan") if y is None else y for y in c["mean"]]
        line, = ax.plot(c["xs"], ys, "-o", ms=3, label=name)
        lo = [y - (h or 0) for y, h in zip(ys, c["ci"])]
        hi = [y + (h or 0) for y, h in zip(ys, c["ci"])]
        ax.fill_between(c["xs"], lo, hi, alpha=0.2, color=line.get_color())
    target = next((a["plain_final_target"] for a in arms.values() if a.get("plain_final_target")), None)
    if metric == "mean_recall" and target is not None:
        ax.axhline(target, ls="--", lw=0.8, color="gray", label="plain final")
    chance = next((a["chance_mean_recall"] for a in arms.values() if a.get("chance_mean_recall")), None)
    if metric == "mean_recall" and chance:
        ax.axhline(chance, ls=":", lw=0.8, color="black", label="chance (test)")
    ax.set_xlabel("samples seen")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{metric} vs samples seen (mean ± 95% CI over seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def efficiency_markdown(recipe, shards, seeds, rows, teachers, cost, measured_bars, arms) -> list[str]:
    from cxrdr.train.evaluation.report import markdown_table, markdown_table_sd

    md = [f"# Efficiency experiment `{recipe['name']}`", "",
          f"shards `{shards}`; seeds {seeds}; every run sees the same samples. Final metrics: test split, last "
          f"checkpoint, `train eval` suite, **mean ± 95 % CI** (t-interval over {len(seeds)} seeds); chance = a "
          f"random ranking. Samples to plain's final: where the arm's seed-mean validation curve first reaches "
          f"plain's final seed-mean validation mean R (linear interpolation; null: never).", "",
          markdown_table_sd(rows, TABLE_COLS, spread="ci"), ""]
    if teachers:
        md += ["## Teachers (trained on their own phantom sets)", "",
               markdown_table([{"run": n, "shard name": t["shard_name"], "model": t["model"],
                                "steps": t["steps"], "train_wall_s": t["train_wall_s"],
                                "own mean R": t["own_test"].get("mean_recall"),
                                "students' test mean R": t["student_test"].get("mean_recall"),
                                "chance": t["student_test"].get("chance_mean_recall"),
                                "students' test i2t R@1": t["student_test"].get("i2t_R@1"),
                                "add-teacher s": t["add_teacher_seconds"]} for n, t in teachers.items()],
                              ["shard name", "model", "steps", "train_wall_s", "own mean R", "students' test mean R",
                               "chance", "students' test i2t R@1", "add-teacher s"], first="run"), ""]
    md += ["## Cost accounting", "", break_even_line(cost), "", "## Bars", ""]
    md += [bar_line(b) for b in measured_bars]
    md += ["", "![metric vs samples](metric_vs_samples.png)", "", "![auc vs samples](auc_vs_samples.png)", "",
           "![step time](step_time.png)", ""]
    return md


def bar_line(bar: dict) -> str:
    verdict = {True: "MET", False: "MISSED", None: "n/a"}[bar["met"]]
    limit = "" if bar.get("limit") is None else f", limit {_num(bar['limit'])}"
    return f"- {verdict}: {bar['bar']} (measured {_num(bar['value'])}{limit})"


def break_even_line(cost: dict) -> str:
    runs = cost.get("break_even_runs")
    return (f"break-even: one-off teacher embedding {cost['total_s']:.1f} s (teachers {', '.join(cost['teachers'])}; "
            f"build {cost['build_teacher_s']:.1f} s + add-teacher {cost['add_teacher_s']:.1f} s) / saving per "
            f"training run {_num(cost.get('saving_per_run_s'))} s (online - stored step, x {cost.get('steps')} steps) "
            f"= **{_num(runs)} training runs**")


def _num(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
