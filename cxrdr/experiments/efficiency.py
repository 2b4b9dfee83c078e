"""`train experiment efficiency`: plain vs reinforced vs online teacher, same samples seen, over seeds.

Every arm (``efficiency.runs``: plain = CLIP only with fresh augmentations; reinforced = stored teacher
embeddings of the stored views; online = the teacher run inside the loop on the same crops) is trained
once per seed in ``efficiency.seeds``. Outputs (``<out>/efficiency/``):

- ``results.json``: per arm ``final_mean_recall`` (list over seeds, test split, full ``train eval``),
  ``samples_to_plain_final`` (samples at which the arm's seed-mean validation curve first reaches plain's
  final seed-mean validation mean R, linearly interpolated; null if never), per-seed curves and rows,
  the cost accounting (one-off teacher seconds, per-run saving, break-even runs, the teachers' training wall
  seconds and ``teacher_compute_s`` = training + embedding) and the bars; per arm ``crossings``: the samples
  ratio (one crossing rule) at ``efficiency.target_fractions`` of plain's final (default 1, 0.95, 0.9);
  ``step_ratio``: each arm's step over plain's by the interleaved benchmark and by the runs' own mean steps;
  ``comparisons``: each ``efficiency.comparisons`` pair [arm, reference] read as every arm is against plain
  (final metric gap with its Welch interval, samples ratio to the reference's own final);
- ``table.md``: mean ± 95 % CI (t-interval over seeds) with chance next to mean R, samples-to-target,
  step costs (interleaved measurement), break-even line, bars met/missed;
- ``metric_vs_samples.png`` / ``auc_vs_samples.png`` (seed-mean curves with 95 % CI bands), ``step_time.png``.

Teachers named in the recipe's ``teachers`` key are trained and added to the shards first
(cxrdr/experiments/teacher_prep.py). A run marked ``plus_teacher_samples: true`` trains for the experiment's
samples plus every sample the reinforced arm's teachers were trained on (plain CLIP given the pipeline's
whole sample count). With ``resume_runs: true`` an interrupted run continues from its last.pt, so the
experiment can finish through repeated short commands (cxrdr/experiments/chunks.py, status.py).
"""
from __future__ import annotations

import json
import math
import shutil
import time
from fractions import Fraction
from pathlib import Path

import torch
import typer

from cxrdr.common.atomic import write_text_atomic
from cxrdr.experiments.carry import carried_from, carried_note
from cxrdr.experiments.chunks import begin
from cxrdr.experiments.efficiency_report import (BENCHMARK_COLS, QUALITY, efficiency_markdown, plot_efficiency,
                                                  plot_per_seed)
from cxrdr.experiments.image_only import image_only_markdown, image_only_results
from cxrdr.experiments.margins import eval_hit_blocks, margins_markdown, pooled_margins
from cxrdr.experiments.recipe import recipe_seeds, set_threads, train_config
from cxrdr.experiments.repro import code_version
from cxrdr.experiments.runs import (claim_results, claimed_in_turn, ensure_shards, eval_curve, evaluate_run,
                                   report_set, result_row, run_training)
from cxrdr.experiments.stats import (crossing_ratio, gap_interval, mean_curve, mean_sd, samples_to_target,
                                    t_interval)
from cxrdr.experiments.teacher_prep import planned_train_samples, students_and_teachers, teacher_seconds
from cxrdr.train.evaluation.report import seed_summary, write_json
from cxrdr.train.config import TrainConfig
from cxrdr.train.loop import Trainer

DEFAULT_RUNS = {"plain": {"mode": "plain"}, "reinforced": {"mode": "reinforced"}}
# run options of efficiency.runs.<arm> that are not TrainConfig fields
PLUS_TEACHER = "plus_teacher_samples"  # train for the experiment's samples + the teachers' training samples
TIMED_ONLY = "step_benchmark_only"     # only timed by the step benchmark (the break-even's online step)
DEFAULT_METRIC = "mean_recall"
# the samples ratio is read at these fractions of the reference's final seed mean (1.0 first: the bars' target)
DEFAULT_TARGET_FRACTIONS = (1.0, 0.95, 0.9)


def target_fractions(spec: dict) -> list[float]:
    """``efficiency.target_fractions`` (default 1.0, 0.95, 0.9): the targets, as fractions of plain's final
    seed-mean curve value, at which every arm's samples ratio is read; 1.0 always comes first."""
    given = [float(f) for f in spec.get("target_fractions") or DEFAULT_TARGET_FRACTIONS]
    if any(not 0 < f <= 1 for f in given):
        raise ValueError(f"efficiency.target_fractions must be in (0, 1], got {given}")
    return [1.0] + [f for f in dict.fromkeys(given) if f != 1.0]


def comparison_pairs(spec: dict, arms: list[str]) -> list[tuple[str, str]]:
    """``efficiency.comparisons``: [[arm, reference arm], ...] read against each other (final metric gap,
    samples ratio to the reference's own final), besides every arm against plain."""
    pairs = [tuple(p) for p in spec.get("comparisons") or []]
    bad = [p for p in pairs if len(p) != 2 or any(a not in arms for a in p)]
    if bad:
        raise ValueError(f"efficiency.comparisons: each entry is [arm, reference arm] of trained arms {arms}, "
                         f"got {bad}")
    return pairs


def metrics_of(spec: dict) -> tuple[str, str, float]:
    """(curve metric of the validation passes, final metric of the row, samples bar's fraction of plain's
    samples): ``efficiency.metric`` (default mean_recall), ``efficiency.final_metric`` (default the curve's),
    ``efficiency.samples_fraction`` (default 1/3)."""
    curve = spec.get("metric", DEFAULT_METRIC)
    return curve, spec.get("final_metric", curve), float(spec.get("samples_fraction", 1 / 3))


# --------------------------------------------------------------------------- runs


def curve_set(recipe: dict, shards: Path, build: bool = True) -> dict:
    """Where the curves are measured: ``efficiency.curve_split: report`` (default) = the report set, so
    every arm's crossing is read on data no choice read; a split name = that split of the training shards
    (``val``: the selection set, for probes that choose settings)."""
    split = (recipe.get("efficiency") or {}).get("curve_split", "report")
    if split != "report":
        return {"eval_split": split}
    report_shards, report_split = report_set(recipe, build=build)
    separate = report_shards.resolve() != Path(shards).resolve()
    return {"eval_split": report_split, **({"eval_shards": str(report_shards)} if separate else {})}


def _arm_runs(recipe: dict, shards: Path, out_dir: Path, name: str, overrides: dict,
              seeds: list[int], build: bool = True) -> list[tuple[int, TrainConfig]]:
    """(seed, config) of every run of one arm. A run's ``shards: {dir, build}`` trains it on shards of its
    own (e.g. plain on the students' and the teacher's images); its final evaluation still reads the report
    set, and its probe is fitted on the recipe's training shards, as every arm's is. ``build=False``
    builds no missing shard folder (a status listing)."""
    spec = recipe.get("efficiency") or {}
    every = spec.get("eval_every_samples")
    overrides = dict(overrides)
    own_shards = overrides.pop("shards", None)
    plus_teacher = bool(overrides.pop(PLUS_TEACHER, False))
    train_shards = (ensure_shards(own_shards) if build else Path(own_shards["dir"])) if own_shards else shards
    curves = curve_set(recipe, shards, build)
    runs = []
    for seed in seeds:
        run_dir = out_dir / "runs" / name / f"seed-{seed}"
        base = train_config(recipe, train_shards, run_dir, overrides, "efficiency")
        per_step = base.batch_size * base.accum_steps
        eval_every = max(1, round(every / per_step)) if every else 0
        extra = {"steps": base.steps + math.ceil(teacher_samples(recipe) / per_step)} if plus_teacher else {}
        runs.append((int(seed), train_config(recipe, train_shards, run_dir,
                                             {"eval_every": eval_every, **curves, "seed": int(seed), **overrides,
                                              **extra},
                                             "efficiency")))
    return runs


def teacher_samples(recipe: dict) -> int:
    """Samples the reinforced arm's stored teachers were trained on (from their configs)."""
    runs = (recipe.get("efficiency") or {}).get("runs") or DEFAULT_RUNS
    rein = {k: v for k, v in (runs.get("reinforced") or {}).items()
            if k not in ("shards", "seeds", PLUS_TEACHER, TIMED_ONLY)}
    names = train_config(recipe, Path("."), Path("."), rein, "efficiency").teachers
    return planned_train_samples(recipe, "efficiency", [n.strip() for n in names.split(",")] if names else None)


def arm_plan(recipe: dict, shards: Path, out_dir: Path, build: bool = True) -> tuple[dict, dict, set]:
    """(arm -> its runs' (seed, config), arm -> its run options without the seeds, the timed-only arms)."""
    spec = recipe.get("efficiency") or {}
    runs = {k: dict(v or {}) for k, v in (spec.get("runs") or DEFAULT_RUNS).items()}
    seeds = recipe_seeds(recipe, spec)
    # a run may name its own seeds (a subset), e.g. an online arm whose teacher-in-the-loop steps do not fit;
    # an arm marked step_benchmark_only is only timed (the break-even needs its step cost), not trained
    timed_only = {name for name, o in runs.items() if o.pop(TIMED_ONLY, False)}
    arm_runs = {name: _arm_runs(recipe, shards, out_dir, name, overrides, _arm_seeds(overrides, seeds), build)
                for name, overrides in runs.items() if name not in timed_only}
    options = {name: {k: v for k, v in o.items() if k not in ("seeds", PLUS_TEACHER)} for name, o in runs.items()}
    return arm_runs, options, timed_only


def runs_in_turn(arm_runs: dict[str, list[tuple[int, TrainConfig]]]) -> list[tuple[str, int, TrainConfig, bool]]:
    """Every run as (arm, seed, config, whether it is its arm's first seed), in the order they are trained: the
    arms' first seeds, then their second seeds, and so on (an arm with fewer seeds drops out). A chunked recipe
    stopped part-way (a GPU lease that ends first) then holds as many seeds of each arm as it got to, paired,
    rather than every seed of the first arm and none of the next."""
    ranked = [(rank, order, name, seed, cfg) for order, (name, runs) in enumerate(arm_runs.items())
              for rank, (seed, cfg) in enumerate(runs)]
    return [(name, seed, cfg, rank == 0) for rank, _, name, seed, cfg in sorted(ranked, key=lambda r: r[:2])]


def _train_arms(recipe: dict, shards: Path, arm_runs: dict[str, list[tuple[int, TrainConfig]]],
                only: set[Path] | None = None) -> dict:
    """Train and evaluate every run (``runs_in_turn``'s order), each while holding its folder's lock
    (``claimed_in_turn``), so two copies of the command split the runs; then per arm its rows and records, in seed
    order. ``only``: just these run folders (``partial.py``: the finished ones; an arm with none of them is left
    out), each with its place in the whole plan (its arm's first seed alone measures the cost)."""
    jobs = {Path(cfg.out): (name, seed, cfg, first) for name, seed, cfg, first in runs_in_turn(arm_runs)
            if only is None or Path(cfg.out) in only}
    arm_runs = {name: kept for name, runs in arm_runs.items()
                if (kept := [(seed, cfg) for seed, cfg in runs if Path(cfg.out) in jobs])}

    def train_and_evaluate(run_dir: Path, lock) -> tuple[dict, dict, dict]:
        name, seed, cfg, first = jobs[run_dir]
        per_step = cfg.batch_size * cfg.accum_steps
        typer.echo(f"[efficiency] {name} seed {seed}: {cfg.steps} steps x {per_step} samples (mode {cfg.mode}, "
                   f"online teacher {cfg.online_teacher}, shards {cfg.shards})", err=True)
        summary = run_training(cfg, recipe.get("reuse_runs", True), lock=lock,
                               resume=recipe.get("resume_runs", False))
        results = evaluate_run(recipe, run_dir, shards, recipe.get("isolated_efficiency", False),
                               efficiency=first,  # cost is the architecture's: one seed
                               after_training=not summary.get("reused"))
        record = {"seed": seed, "train_config": cfg.to_dict(), "train_summary": summary,
                  "curve": eval_curve(run_dir, per_step), "final": results["summary"],
                  "carried": carried_from(run_dir)}  # trained on an earlier GPU lease (carry.py), or None
        return result_row(name, summary, results, per_step), record, eval_hit_blocks(results)

    def busy(run_dir: Path) -> None:
        typer.echo(f"[efficiency] {run_dir} is being trained by another copy: doing the others first", err=True)

    done = claimed_in_turn(list(jobs), train_and_evaluate, busy)
    return {name: {"rows": [done[Path(cfg.out)][0] for _, cfg in runs],
                   "seeds": [done[Path(cfg.out)][1] for _, cfg in runs],
                   "margins": pooled_margins([done[Path(cfg.out)][2] for _, cfg in runs])}
            for name, runs in arm_runs.items()}


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
    begin("step benchmark")
    typer.echo(f"[efficiency] interleaved step benchmark: {bench['steps']} steps per arm", err=True)
    cfgs = {r: train_config(recipe, shards, out_dir / "step-benchmark" / r,
                            # scratch folders: a re-run of the experiment measures afresh over them
                            dict(runs[r] or {}, steps=10**6, eval_every=0, progress=False, seed=seed,
                                 overwrite=True),
                            "efficiency") for r in runs if not (runs[r] or {}).get("shards")}
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


def samples_limit(plain_samples: float, fraction: float = 1 / 3) -> float:
    """The first bar's limit: reinforced reaches plain's final within ``fraction`` of plain's samples."""
    return plain_samples * fraction


RATIO_UPPER_SLACK = 1.2  # the ratio's 95 % upper bound must stay within 1.2x the fraction (0.40 for 1/3)


def bars(arms: dict, bench: dict, plain_total: float, curve: str = DEFAULT_METRIC, final: str = DEFAULT_METRIC,
         fraction: float = 1 / 3, upper: float | None = None, pointing: dict | None = None,
         margins: dict | None = None) -> list[dict]:
    """The bars, measured: met True/False, None where a figure is missing. The samples bar reads the one
    crossing rule (``stats.crossing_ratio``: each arm's first crossing, plain's included) against ``fraction``,
    its 95 % upper bound against ``upper`` (default ``RATIO_UPPER_SLACK`` x fraction, 0.40 for 1/3); the old
    definition (reinforced's first crossing / plain's whole budget) is kept beside it, not judged.
    ``pointing`` (recipe ``efficiency.pointing_bars``: ``arms``, ``over_train_prior``): each arm's pointing games
    (z, attention) on the report set at least that far above the train-box prior, read from ``margins`` (the
    paired per-seed margins pooled over seeds, ``margins_over_train_prior``)."""
    out = []
    rein, plain = arms.get("reinforced"), arms.get("plain")
    if rein and plain:
        c = rein["crossing"]
        ratio, hi = c["ratio"], c["ratio_ci"][1]
        share = Fraction(fraction).limit_denominator(10)
        upper = round(RATIO_UPPER_SLACK * fraction, 2) if upper is None else round(float(upper), 3)
        out.append({"bar": f"reinforced reaches plain's final {_label(curve)} with <= {share} of plain's samples "
                           f"(first crossing for both arms) and the ratio's 95 % upper bound <= {upper}",
                    "value": ratio, "ci": c["ratio_ci"], "limit": fraction,
                    "met": None if ratio is None else ratio <= fraction and hi is not None and hi <= upper})
        s = rein["samples_to_plain_final"]
        out.append({"bar": "(old definition, not judged) reinforced's first crossing / plain's whole budget",
                    "value": None if s is None else s / plain_total, "limit": fraction, "met": None})
        p_mean, p_sd = mean_sd(plain[f"final_{final}"])
        r_mean, _ = mean_sd(rein[f"final_{final}"])
        gap = None if r_mean is None or p_mean is None else r_mean - p_mean
        out.append({"bar": f"reinforced final {_label(final)} - plain's > 2 sd of plain's seeds", "value": gap,
                    "limit": None if p_sd is None else 2 * p_sd,
                    "met": None if gap is None or p_sd is None else gap > 2 * p_sd})
    out += pointing_bars(pointing, margins or {})
    ratios = (("stored step <= 1.05x no-teacher step", "reinforced", "plain", lambda r: r <= 1.05),
              ("online step >= 3x stored step", "online", "reinforced", lambda r: r >= 3.0))
    for text, a, b, ok in ratios:
        r = bench[a] / bench[b] if bench.get(a) and bench.get(b) else None
        out.append({"bar": text, "value": r, "met": None if r is None else ok(r)})
    return out


def pointing_bars(spec: dict | None, margins: dict) -> list[dict]:
    """``spec`` {arms, over_train_prior}: per arm and pointing game, its seed-mean margin over the train-box prior
    >= over_train_prior, with the margin's 95 % interval over images and seeds beside it."""
    out = []
    for arm in (spec or {}).get("arms", []):
        for figure in ("pointing_z", "pointing_attn"):
            m = (margins.get(arm) or {}).get(figure) or {}
            value, over = m.get("margin"), float(spec["over_train_prior"])
            out.append({"bar": f"{arm} {figure} - train-box prior >= {over:g} on the report set (seed mean of the "
                               "paired per-seed margins)", "value": value, "ci": m.get("interval"), "limit": over,
                        "met": None if value is None else value >= over})
    return out


# --------------------------------------------------------------------------- experiment


def efficiency_experiment(recipe: dict, out_dir: Path, progress: bool = True) -> dict:
    set_threads(recipe)
    shards, teachers = students_and_teachers(recipe, progress, experiment="efficiency")
    spec = recipe.get("efficiency") or {}
    seeds = recipe_seeds(recipe, spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    arm_runs, runs, timed_only = arm_plan(recipe, shards, out_dir)
    trained = _train_arms(recipe, shards, arm_runs)  # two copies of the command split the runs
    lock, written = claim_results(out_dir)  # ... and one of them times the step benchmark and writes the results
    if written is not None:
        return written
    try:
        return _results(recipe, out_dir, shards, teachers, spec, seeds, trained, runs, timed_only)
    finally:
        lock.release()


def _results(recipe: dict, out_dir: Path, shards: Path, teachers: dict, spec: dict, seeds: list, trained: dict,
             runs: dict, timed_only: list, partial: dict | None = None) -> dict:
    """The step benchmark, then results.json, table.md and the plots from the trained arms. ``partial``: what a
    report of the runs finished so far leaves out (``partial.py``), stated first in both files; it times no step."""
    bench = {} if partial else _step_benchmark(recipe, shards, out_dir, runs, seeds[0])
    curve_metric, final_metric, fraction = metrics_of(spec)
    fractions = target_fractions(spec)
    pairs = comparison_pairs(spec, list(trained))
    arms, rows = _summarise_arms(trained, bench, curve_metric, final_metric, fractions)
    rows += [{"run": name, "bench_step_ms": bench.get(name), "note": "step benchmark only"} for name in timed_only]
    info = json.loads((shards / "dataset.json").read_text())
    steps = trained[next(iter(trained))]["seeds"][0]["train_config"]["steps"]
    used = _stored_teachers(trained, info)
    cost = one_off_teacher_seconds(info, used)
    cost.update(break_even(cost["total_s"], bench.get("online"), bench.get("reinforced"), steps))
    cost.update(teacher_data(teachers, used, arms))
    cost["teacher_compute_s"] = (cost["teacher_train_wall_s"] + cost["total_s"]
                                 if cost.get("teacher_train_wall_s") is not None else None)
    steps_ratio = step_ratios(rows, bench)
    comparisons = [compare_arms(trained, a, b, curve_metric, final_metric, fractions) for a, b in pairs]
    plain_total = max((r["samples_seen"] or 0) for r in trained.get("plain", trained[next(iter(trained))])["rows"])
    margins = {n: t["margins"] for n, t in trained.items() if t["margins"]}
    measured_bars = bars(arms, bench, plain_total, curve_metric, final_metric, fraction, spec.get("samples_upper"),
                         spec.get("pointing_bars"), margins)
    image_only = image_only_results(spec["judge"], trained, shards, final_metric) if spec.get("judge") else None
    if image_only:
        measured_bars += image_only["bars"]
    report_shards, report_split = report_set(recipe)
    result = {"experiment": "efficiency", "code": code_version(),  # the runs' own: runs/<arm>[].train_summary.code
              "recipe": recipe, "shards": str(shards), "seeds": seeds,
              "curve_split": spec.get("curve_split", "report"), "curve_metric": curve_metric,
              "final_metric": final_metric,
              "protocol": {"report_shards": str(report_shards), "report_split": report_split,
                           "selection": recipe.get("selection") or {}}, "teachers": teachers, "arms": arms,
              "bench_step_ms": bench, "step_ratio": steps_ratio, "cost": cost, "bars": measured_bars,
              "target_fractions": fractions, "comparisons": comparisons, "table": rows,
              "margins_over_train_prior": margins,
              "runs": {n: t["seeds"] for n, t in trained.items()},
              **({"image_only": image_only} if image_only else {}), **({"partial": partial} if partial else {})}
    write_json(result, out_dir / "results.json")
    if not partial:  # the recipe's own results replace a report of its runs finished earlier (partial.py)
        shutil.rmtree(out_dir / "partial", ignore_errors=True)
    plain_x = (arms.get("plain") or {}).get("crossing", {}) or {}
    plot_efficiency(arms, bench, rows, spec.get("curve_split", "report"), out_dir,
                    samples_limit(plain_x.get("plain_samples") or plain_total, fraction), curve_metric,
                    f"{Fraction(fraction).limit_denominator(10)} of plain's first crossing")
    plot_per_seed({n: [(r["seed"], r["curve"]) for r in t["seeds"]] for n, t in trained.items()}, curve_metric,
                  f"{curve_metric} ({spec.get('curve_split', 'report')})", out_dir / "metric_vs_samples_per_seed.png",
                  plain_x.get("target"))
    md = efficiency_markdown(recipe, shards, seeds, rows, teachers, cost, measured_bars, arms, result["protocol"],
                             curve_metric, final_metric, steps_ratio, comparisons)
    if partial:
        md = [f"**Partial results**: {partial['note']}", ""] + md
    carried = carried_note(result["runs"])
    md = ([carried, ""] if carried else []) + md
    md += image_only_markdown(image_only) if image_only else []
    md += margins_markdown(result["margins_over_train_prior"])
    write_text_atomic(out_dir / "table.md", "\n".join(md))
    typer.echo("\n".join(md))
    return result


def teacher_data(teachers: dict, used: list[str], arms: dict) -> dict:
    """The teachers' own training samples in the accounting: a reinforced student's samples to plain's
    final plus every sample its stored teachers were trained on, beside plain's own first crossing."""
    mine = [t for t in teachers.values() if t.get("shard_name") in used]
    samples = sum(int(t.get("train_samples") or 0) for t in mine)
    shared = [t["train_images_shared"] for t in mine if t.get("train_images_shared") is not None]
    rein, plain = arms.get("reinforced") or {}, arms.get("plain") or {}
    c = rein.get("crossing") or {}
    own, plain_x = c.get("samples"), c.get("plain_samples")
    total = None if own is None else own + samples
    walls = [t.get("train_wall_s") for t in mine]
    return {"teacher_train_samples": samples, "teacher_train_images_shared": min(shared) if shared else None,
            # the teachers' own training, wall seconds as their runs recorded them (None: one was not recorded)
            "teacher_train_wall_s": sum(walls) if walls and None not in walls else None,
            "reinforced_samples_with_teacher": total,
            "reinforced_ratio_with_teacher": None if total is None or not plain_x else total / plain_x,
            "plain_samples_to_own_final": plain_x or (plain.get("crossing") or {}).get("plain_samples")}


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
                    final_metric: str = DEFAULT_METRIC, fractions: list[float] | None = None
                    ) -> tuple[dict, list[dict]]:
    curves = {n: mean_curve([s["curve"] for s in t["seeds"]], metric) for n, t in trained.items()}
    plain = curves.get("plain")
    target = plain["mean"][-1] if plain and plain["mean"] else None
    plain_curves = [s["curve"] for s in trained["plain"]["seeds"]] if "plain" in trained else None
    arms, rows = {}, []
    for name, t in trained.items():
        row = _arm_row(name, t, final_metric)
        c = curves[name]
        reach = samples_to_target(c["xs"], c["mean"], target) if target is not None else None
        per_seed = [samples_to_target([p["samples_seen"] for p in s["curve"]],
                                      [p[metric] for p in s["curve"]], target) if target is not None else None
                    for s in t["seeds"]]
        crossing = crossing_ratio([s["curve"] for s in t["seeds"]], plain_curves, metric) if plain_curves else None
        # the same rule at lower targets (fractions of plain's final): how far the ratio leans on the last points
        crossings = ([crossing] + [crossing_ratio([s["curve"] for s in t["seeds"]], plain_curves, metric, fraction=f)
                                   for f in (fractions or [])[1:]]) if plain_curves else None
        row.update(samples_to_plain_final=reach, bench_step_ms=bench.get(name),
                   samples_ratio=crossing["ratio"] if crossing else None,
                   samples_ratio_ci=crossing["ratio_ci"] if crossing else None)
        rows.append(row)
        arms[name] = {f"final_{final_metric}": row[f"{final_metric}_seeds"], "samples_to_plain_final": reach,
                      "final_metric": final_metric, "curve_metric": metric,
                      "crossing": crossing, **({"crossings": crossings} if fractions else {}),
                      "curve_probe_mean_auc": mean_curve([s["curve"] for s in t["seeds"]], "probe_mean_auc"),
                      "samples_to_plain_final_per_seed": per_seed, "plain_final_target": target,
                      "chance_mean_recall": row.get("chance_mean_recall"), "curve_mean": c,
                      "final": {k: row.get(k) for k in row if not k.startswith("run")}}
    return arms, rows


def step_ratios(rows: list[dict], bench: dict, reference: str = "plain") -> dict:
    """Each arm's step cost over the reference arm's, two ways: the interleaved benchmark's medians
    (every config steps in turn, same load) and the runs' own mean step times (``train_summary``
    mean_step_ms, averaged over seeds: whatever else the machine did during each run)."""
    runs = {r["run"]: r.get("step_ms") for r in rows}
    ref_run, ref_bench = runs.get(reference), bench.get(reference)
    return {name: {"bench_step_ms": bench.get(name), "run_step_ms": ms,
                   "bench_ratio": bench[name] / ref_bench if bench.get(name) and ref_bench else None,
                   "runs_ratio": ms / ref_run if ms and ref_run else None}
            for name, ms in runs.items() if name != reference}


def compare_arms(trained: dict, arm: str, reference: str, metric: str = DEFAULT_METRIC,
                 final_metric: str = DEFAULT_METRIC, fractions: list[float] | None = None) -> dict:
    """``arm`` read against ``reference`` as every arm is read against plain: the final metric's gap (Welch
    95 % interval over the two arms' seeds, each arm's sd, the reference's 2 sd) and the samples ratio
    (first crossings of the seed-mean curves) at ``fractions`` of the reference's own final."""
    finals = [[row.get(final_metric) for row in trained[x]["rows"]] for x in (arm, reference)]
    gap = gap_interval(*finals)
    curves = [[s["curve"] for s in trained[x]["seeds"]] for x in (arm, reference)]
    return {"arm": arm, "against": reference, "final_metric": final_metric, "curve_metric": metric,
            f"final_{final_metric}": finals[0], f"against_final_{final_metric}": finals[1], **gap,
            "two_sd_against": None if gap["ref_sd"] is None else 2 * gap["ref_sd"],
            "crossings": [crossing_ratio(*curves, metric, fraction=f) for f in (fractions or [1.0])]}
