"""The efficiency experiment's table.md and plots."""
from __future__ import annotations

from pathlib import Path

from cxrdr.common.plots import pyplot, save_figure
from cxrdr.experiments.stats import mean_curve
from cxrdr.train.evaluation.report import markdown_table, markdown_table_sd, plot_bars

QUALITY = ["i2t_R@1", "t2i_R@1", "mean_recall", "chance_mean_recall", "oracle_mean_recall", "mean_recall_findings",
           "probe_auc", "zeroshot_auc"]
# the NIH box benchmark's headline numbers, when the recipe's eval runs it (eval.benchmark)
BENCHMARK_COLS = ("zero_shot_auc_mean", "pg_z", "pg_z_chance", "pg_z_prior", "pg_z_train_prior", "pg_attention",
                  "pg_attention_chance", "pg_attention_prior", "pg_attention_train_prior")
TABLE_COLS = ["n_seeds"] + QUALITY + ["samples_to_plain_final", "samples_ratio", "samples_seen", "wall_s", "step_ms",
                                      "bench_step_ms"]


def plot_efficiency(arms: dict, bench: dict, rows: list[dict], curve_split: str, out_dir: Path,
                    samples_limit: float | None = None, curve_metric: str = "mean_recall",
                    limit_label: str = "1/3 of plain's first crossing") -> None:
    for metric, ylabel, path in ((curve_metric, f"{curve_metric} ({curve_split})", "metric_vs_samples.png"),
                                 ("probe_mean_auc", f"probe AUC ({curve_split}, half-subject)", "auc_vs_samples.png")):
        plot_bands(arms, metric, ylabel, out_dir / path, samples_limit, limit_label)
    plot_bars({r["run"]: r.get("bench_step_ms") or r["step_ms"] for r in rows}, "ms / step",
              "training step time (interleaved median)" if bench else "training step time (run mean)",
              out_dir / "step_time.png")


def plot_per_seed(per_seed: dict, metric: str, ylabel: str, path: Path, target: float | None = None) -> None:
    """Every seed's own curve (thin lines, one colour per arm) with the arm's seed mean (thick): the spread
    the mean-and-band plot summarises, and where single seeds cross plain's final."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    for i, (name, curves) in enumerate(per_seed.items()):
        color = f"C{i}"
        for seed, curve in curves:
            points = [(p["samples_seen"], p[metric]) for p in curve if p.get(metric) is not None]
            if points:
                ax.plot(*zip(*points), "-", lw=0.7, alpha=0.5, color=color)
        mean = mean_curve([c for _, c in curves], metric)
        if mean["xs"]:
            ax.plot(mean["xs"], [float("nan") if y is None else y for y in mean["mean"]], "-", lw=2, color=color,
                    label=f"{name} ({len(curves)} seeds)")
    if target is not None:
        ax.axhline(target, ls="--", lw=0.8, color="gray", label="plain final (seed mean)")
    _save_samples_plot(plt, fig, ax, ylabel, f"{metric} vs samples seen, every seed (thin) and the seed mean (thick)",
                       path)


def plot_bands(arms: dict, metric: str, ylabel: str, path: Path, samples_limit: float | None = None,
               limit_label: str = "1/3 of plain's first crossing") -> None:
    """Seed-mean validation curve per arm with its 95 % t-interval band; plain's final mean as a line, where
    each arm reaches it, and the samples bar's limit."""
    main = next((a.get("curve_metric", "mean_recall") for a in arms.values()), "mean_recall")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    for name, arm in arms.items():
        c = arm["curve_mean"] if metric == main else arm.get(f"curve_{metric}") or {}
        if not c.get("xs"):
            continue
        ys = [float("nan") if y is None else y for y in c["mean"]]
        line, = ax.plot(c["xs"], ys, "-o", ms=3, label=name)
        lo = [y - (h or 0) for y, h in zip(ys, c["ci"])]
        hi = [y + (h or 0) for y, h in zip(ys, c["ci"])]
        ax.fill_between(c["xs"], lo, hi, alpha=0.2, color=line.get_color())
        crossing, target = arm.get("samples_to_plain_final"), arm.get("plain_final_target")
        if metric == main and crossing is not None and target is not None:
            ax.plot([crossing], [target], "v", ms=8, color=line.get_color(), markeredgecolor="black", zorder=5)
    target = next((a["plain_final_target"] for a in arms.values() if a.get("plain_final_target")), None)
    if metric == main and target is not None:
        ax.axhline(target, ls="--", lw=0.8, color="gray", label="plain final (v: where an arm reaches it)")
        if samples_limit is not None:
            ax.axvline(samples_limit, ls="-.", lw=0.8, color="gray", label=limit_label)
    chance = next((a["chance_mean_recall"] for a in arms.values() if a.get("chance_mean_recall")), None)
    if metric == main == "mean_recall" and chance:
        ax.axhline(chance, ls=":", lw=0.8, color="black", label="chance (the final evaluation's set)")
    _save_samples_plot(plt, fig, ax, ylabel, f"{metric} vs samples seen (mean ± 95% CI over seeds)", path)


def _save_samples_plot(plt, fig, ax, ylabel: str, title: str, path: Path) -> None:
    """Axes, title, grid and legend of a metric-vs-samples-seen plot; written to ``path`` and closed."""
    ax.set_xlabel("samples seen")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def efficiency_markdown(recipe, shards, seeds, rows, teachers, cost, measured_bars, arms, protocol=None,
                        curve_metric="mean_recall", final_metric="mean_recall", step_ratio=None,
                        comparisons=None) -> list[str]:
    protocol = protocol or {}
    extra = [c for c in dict.fromkeys((final_metric,) + BENCHMARK_COLS)
             if c not in TABLE_COLS and any(f"{c}_seeds" in r for r in rows)]
    md = [f"# Efficiency experiment `{recipe['name']}`", "",
          f"shards `{shards}`; seeds {seeds}; every run sees the same samples. Final metrics: the **report set** "
          f"(`{protocol.get('report_shards', shards)}`, split {protocol.get('report_split', 'test')}: no setting "
          f"was chosen on it), last checkpoint, `train eval` suite, **mean ± 95 % CI** (t-interval over seeds); "
          f"chance = a random ranking; oracle = the strict mean R of a model that knows each study's findings "
          f"and nothing else; 'same findings' counts a candidate with the query's finding set as correct. "
          f"Samples to plain's final: where the arm's seed-mean curve (curves: "
          f"{recipe.get('efficiency', {}).get('curve_split', 'report')}) of {curve_metric} first reaches "
          f"plain's final seed-mean {curve_metric} (linear interpolation; null: never) - plain's own row is its own "
          f"first crossing, and 'samples ratio' = arm / plain under that one rule, [95 % bootstrap interval over "
          f"seeds]. Final metric of the bars: {final_metric}.", "",
          markdown_table_sd(rows, TABLE_COLS[:1] + extra + TABLE_COLS[1:], spread="ci"), ""]
    ratio_rows = [r for r in rows if r.get("samples_ratio_ci")]
    if ratio_rows:
        md += ["Samples ratio to plain (first crossing for every arm) with its 95 % interval: " + "; ".join(
            f"{r['run']} {_num(r['samples_ratio'])} [{_num(r['samples_ratio_ci'][0])}, "
            f"{_num(r['samples_ratio_ci'][1])}]" for r in ratio_rows), ""]
    md += targets_table(arms, curve_metric)
    md += step_ratio_lines(step_ratio)
    if teachers:
        columns = ["shard name", "model", "steps", "train_wall_s", "own mean R", "students' test mean R",
                   "chance", "students' test i2t R@1", "add-teacher s"]
        # a teacher judged on the report set too (teachers.evaluate): its retrieval and pointing games there
        report_cols = {"report mean R": "mean_recall", "report chance": "chance_mean_recall",
                       "report PG z": "pointing_z", "report PG z train prior": "train_prior_pointing_z",
                       "report PG attn": "pointing_attn", "report PG attn train prior": "train_prior_pointing_attn"}
        on_report = any(t.get("report") for t in teachers.values())
        if on_report:
            columns[-1:-1] = list(report_cols)
        md += ["## Teachers (trained once on their own shards: see the recipe's teachers.build)", "",
               markdown_table([{"run": n, "shard name": t["shard_name"], "model": t["model"],
                                "steps": t["steps"], "train_wall_s": t["train_wall_s"],
                                "own mean R": (t.get("own_test") or {}).get("mean_recall"),
                                "students' test mean R": (t.get("student_test") or {}).get("mean_recall"),
                                "chance": (t.get("student_test") or {}).get("chance_mean_recall"),
                                "students' test i2t R@1": (t.get("student_test") or {}).get("i2t_R@1"),
                                "add-teacher s": t["add_teacher_seconds"],
                                **{c: (t.get("report") or {}).get(k) for c, k in report_cols.items()}}
                               for n, t in teachers.items()], columns, first="run"), ""]
    md += ["## Cost accounting", "", break_even_line(cost), ""]
    md += teacher_compute_lines(cost, rows)
    if cost.get("teacher_train_samples"):
        md += [f"The teacher's data: its training saw {cost['teacher_train_samples']:,} samples "
               f"{_teacher_images(cost.get('teacher_train_images_shared'))}. Counted in, reinforced needs "
               f"{_num(cost.get('reinforced_samples_with_teacher'))} "
               f"samples to plain's final = **{_num(cost.get('reinforced_ratio_with_teacher'))}x** plain's own "
               f"first crossing ({_num(cost.get('plain_samples_to_own_final'))}). The arm trained plain on the "
               f"students' and the teacher's images (if present above) separates what more data buys from what "
               f"distillation buys.", ""]
    for c in comparisons or []:
        md += comparison_lines(c)
    md += ["## Bars", ""]
    md += [bar_line(b) for b in measured_bars]
    md += ["", "![metric vs samples](metric_vs_samples.png)", "",
           "![every seed's curve](metric_vs_samples_per_seed.png)", "", "![auc vs samples](auc_vs_samples.png)", "",
           "![step time](step_time.png)", ""]
    return md


def _ratio(c: dict | None) -> str:
    """A crossing's ratio with its interval and the two crossings: '0.36 [0.32, 0.49] (4,589 / 12,800)'."""
    if not c:
        return "n/a"
    lo, hi = c.get("ratio_ci") or [None, None]
    return (f"{_num(c.get('ratio'))} [{_num(lo)}, {_num(hi)}] ({_num(c.get('samples'))} / "
            f"{_num(c.get('plain_samples'))})")


def targets_table(arms: dict, curve_metric: str = "mean_recall") -> list[str]:
    """The samples ratio at every target (fractions of plain's final seed mean), one row per arm."""
    with_targets = {n: a["crossings"] for n, a in arms.items() if a.get("crossings")}
    if not with_targets:
        return []
    first = next(iter(with_targets.values()))
    heads = [f"{c.get('fraction', 1.0):.0%} of plain's final ({_num(c.get('target'))})" for c in first]
    lines = ["| arm | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(_ratio(c) for c in cs) + " |" for n, cs in with_targets.items()]
    return [f"Samples ratio at three targets (one rule: each arm's first crossing of its seed-mean {curve_metric} "
            f"curve / plain's own first crossing of the same target; [95 % bootstrap interval over seeds] "
            f"(arm's samples / plain's); 'inf': some resamples never reach it; n/a: the seed mean never does):", ""
            ] + lines + [""]


def step_ratio_lines(step_ratio: dict | None) -> list[str]:
    """Each arm's step over plain's: the interleaved benchmark beside the runs' own mean steps."""
    if not step_ratio:
        return []
    return ["Step cost over plain's: " + "; ".join(
        f"{n} {_num(r.get('bench_ratio'))}x by the interleaved benchmark (median {_num(r.get('bench_step_ms'))} ms), "
        f"{_num(r.get('runs_ratio'))}x by the runs' own mean steps ({_num(r.get('run_step_ms'))} ms, seed mean)"
        for n, r in step_ratio.items()), ""]


def teacher_compute_lines(cost: dict, rows: list[dict]) -> list[str]:
    """The teachers' compute in seconds: their training runs' wall time plus the embedding passes."""
    if cost.get("teacher_compute_s") is None:
        return []
    plain = next((r for r in rows if r["run"] == "plain"), None)
    run_s = f"; one plain student run took {_num(plain.get('wall_s'))} s (seed mean)" if plain else ""
    return [f"Teacher compute: training {_num(cost['teacher_train_wall_s'])} s (wall, as the teacher runs recorded "
            f"it) + embedding the students' shards {_num(cost['total_s'])} s (build + add-teacher) = "
            f"**{_num(cost['teacher_compute_s'])} s**{run_s}.", ""]


def comparison_lines(c: dict) -> list[str]:
    """One arm read against a reference arm: final metric gap and the samples ratio to its own final."""
    metric = c["final_metric"]
    lo, hi = c.get("gap_ci") or [None, None]
    ratios = "; ".join(f"{x.get('fraction', 1.0):.0%} of its final ({_num(x.get('target'))}): {_ratio(x)}"
                       for x in c["crossings"])
    return [f"## {c['arm']} against {c['against']}", "",
            f"- final {metric}: {c['arm']} {_num(c.get('arm_mean'))} (sd {_num(c.get('arm_sd'))}, {c['n_arm']} seeds) "
            f"vs {c['against']} {_num(c.get('ref_mean'))} (sd {_num(c.get('ref_sd'))}, {c['n_ref']} seeds): gap "
            f"**{_num(c.get('gap'))}** [95 % Welch {_num(lo)}, {_num(hi)}]; 2 sd of {c['against']}'s seeds "
            f"{_num(c.get('two_sd_against'))}",
            f"- samples ratio, {c['arm']}'s first crossing / {c['against']}'s own first crossing of a target: {ratios}",
            ""]


def _teacher_images(shared: float | None) -> str:
    if shared is None:
        return "(its images' overlap with the students' was not recorded)"
    if shared == 0:
        return "of images the students never see"
    if shared == 1:
        return "of the students' own training images (no image the students do not see; more passes, not more data)"
    return f"of images {shared:.0%} of which are the students' training images"


def bar_line(bar: dict) -> str:
    verdict = {True: "MET", False: "MISSED", None: "n/a"}[bar["met"]]
    limit = "" if bar.get("limit") is None else f", limit {_num(bar['limit'])}"
    ci = "" if not bar.get("ci") else f" [95 % {_num(bar['ci'][0])}, {_num(bar['ci'][1])}]"
    return f"- {verdict}: {bar['bar']} (measured {_num(bar['value'])}{ci}{limit})"


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
