#!/usr/bin/env python
"""Every results-backed figure and verdict of the README and docs/, generated from the committed results
(issues 28 and 37): the efficiency recipe and the A-E ladder on their evaluation phantoms over fresh seeds
(mean ± 95 % CI beside chance and the train-box prior, every bar MET or MISSED as measured), the ladder's
paired per-seed margins over the train-box prior, what the efficiency figure does not control, the first
(superseded) report-set measurement, the NIH tables and bars, and which set chose every recipe setting.

    python scripts/headline.py [EFFICIENCY.json] [LADDER.json]   # print the two headline tables
    python scripts/headline.py --write     # rewrite every generated block in README.md and docs/*.md
    python scripts/headline.py --check     # exit 1 when a block differs from what the results give
    python scripts/headline.py --derive    # recompute docs/results/cpu-demo-efficiency-checks.json

A generated block sits between ``<!-- headline.py:NAME -->`` and ``<!-- /headline.py:NAME -->``; its text is
``BLOCKS[NAME]()`` exactly (tests/test_docs_results.py checks every block of every page). Inputs:
docs/results/*.json (the experiments' own results.json), docs/results/nih-tables.md (scripts/nih-tables.py:
the NIH arms' per-finding tables), docs/results/superseded/ (earlier measurements, kept for disclosure),
docs/results/provenance.yaml (which set chose each recipe setting) and configs/experiments/*.yaml.
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import math
import re
import sys
from pathlib import Path

from scipy.stats import t as student_t

from cxrdr.common.yamlio import safe_load
from cxrdr.experiments.partial_note import partial_caveat, seeds_by_arm
from cxrdr.experiments.recipe_file import load_recipe
from cxrdr.experiments.stats import gap_interval, t_interval, welch_half_width

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
EFFICIENCY = RESULTS / "cpu-demo-efficiency.json"
CONTROLS = RESULTS / "cpu-demo-controls.json"
CONTROLS_PROBE = RESULTS / "cpu-demo-controls-lr-probe.json"
# the controls' missing cell (stop 73): reinforced with the pretrained MiniLM text tower, paired with plain-minilm-tuned
CONTROLS_MINILM = RESULTS / "cpu-demo-controls-reinforced-minilm.json"
DISTILL_PROBE = RESULTS / "cpu-demo-controls-distill-probe.json"
CONTROLS_STRONG = RESULTS / "cpu-demo-controls-strong-teacher.json"
TEACHER_REPORT = RESULTS / "cpu-demo-controls-teacher-report.json"
# the stronger teacher with MiniLM students (stop 77): the cell closest to the GPU recipe's students
CONTROLS_STRONG_MINILM = RESULTS / "cpu-demo-controls-strong-teacher-minilm.json"
LADDER = RESULTS / "cpu-ladder.json"
IMAGE_ONLY = RESULTS / "image-only.json"
NIH_RETRIEVED = RESULTS / "nih-retrieved.json"
NIH = RESULTS / "nih-efficiency.json"
GPU_EFFICIENCY = RESULTS / "gpu-efficiency.json"  # issue 36: the GPU recipe's results.json, once a GPU has run it
# until then, the latest lease's `train experiment efficiency --partial` results.json (which lease: GPU_PARTIAL_LEASE)
GPU_EFFICIENCY_PARTIAL = RESULTS / "gpu-efficiency-partial.json"
GPU_PARTIAL_LEASE = "one H200 lease at 355812b, 2026-11-27 (docs/gpu.md, \"Tenth GPU session\")"
GPU_RECIPE = ROOT / "configs" / "experiments" / "gpu-efficiency.yaml"
NIH_TABLES = RESULTS / "nih-tables.md"
CHECKS = RESULTS / "cpu-demo-efficiency-checks.json"
FIRST = RESULTS / "superseded" / "cpu-demo-efficiency-00389eb.json"
FIRST_COMMIT, FIRST_DATE = "00389eb", "2026-11-25"
# the ladder's previous measurement (same recipe and seeds, older code; its runs recorded no commit)
LADDER_BEFORE = RESULTS / "superseded" / "cpu-ladder-20204e6.json"
LADDER_BEFORE_COMMIT, LADDER_BEFORE_DATE = "20204e6", "2026-11-25"
# the NIH recipe's first results file (its runs trained by code up to 20d0d7f, recording none)
NIH_BEFORE_COMMIT = "20d0d7f"
NIH_BEFORE = RESULTS / "superseded" / f"nih-efficiency-{NIH_BEFORE_COMMIT}.json"
SECOND_COMMIT = "40ff7b2"
PROVENANCE = RESULTS / "provenance.yaml"
RECIPES = ROOT / "configs" / "experiments"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- headline\.py:([\w-]+) -->\n)(.*?)(<!-- /headline\.py:\2 -->)", re.S)
# Wang et al., CVPR 2017 (ChestX-ray8), T(IoBB) > 0.1 per finding: a published figure, not a result of ours
WANG_2017 = {"Atelectasis": 0.69, "Cardiomegaly": 0.94, "Effusion": 0.66, "Infiltrate": 0.71, "Mass": 0.40,
             "Nodule": 0.14, "Pneumonia": 0.63, "Pneumothorax": 0.38}
NIH_AUC_BAR, NIH_PG_MARGIN = 0.70, 0.10   # issue 24's NIH bars: mean zero-shot AUC; PG over a prior + 0.10


# --------------------------------------------------------------------------- formatting


def _ci(values) -> str:
    """mean ± 95 % t-interval over seeds; a value that is the same on every seed (chance, the train-box
    prior: one fixed number per report set) prints alone, without a ± that would look like certainty."""
    values = [v for v in values or [] if v is not None]
    if values and max(values) == min(values):
        return f"{values[0]:.3f}"
    mean, half = t_interval(values)
    if mean is None:
        return "n/a"
    return f"{mean:.3f}" + (f" ± {half:.3f}" if half is not None else "")


def _num(v, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    return "never" if v == float("inf") else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _signed(v: float, digits: int = 3) -> str:
    """+0.089 / −0.089 (a real minus sign, as the prose uses)."""
    return f"{v:+.{digits}f}".replace("-", "−")


def _verdict(met) -> str:
    return {True: "**MET**", False: "**MISSED**"}.get(met, "not judged")


def _final(arm: dict, key: str) -> list:
    return (arm.get("final") or {}).get(f"{key}_seeds") or []


def _interval(values: list[float]) -> tuple[float, float, float]:
    mean, half = t_interval(values)
    return mean, mean - half, mean + half


@functools.lru_cache(maxsize=None)
def _load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- phantom efficiency


def _upper(ci: list) -> str:
    """A crossing ratio's upper bound: null with a lower bound means some resamples never cross ('inf')."""
    return "inf" if ci[1] is None and ci[0] is not None else _num(ci[1])


def efficiency(res: dict, config: str = "configs/experiments/cpu-demo.yaml") -> list[str]:
    arms, cost = res["arms"], res.get("cost") or {}
    # the arms trained over fewer seeds than the recipe's list name their own (plain-more-data, online, ...)
    own = [name for name, arm in arms.items() if len(arm.get("final_mean_recall") or []) not in (0, len(res["seeds"]))]
    lines = [f"**Efficiency** (`train experiment efficiency --config {config}`; report "
             f"set `{res['protocol']['report_shards']}`; seeds {res['seeds']}"
             + (f", {' and '.join(own)} on {'their own seed lists' if len(own) > 1 else 'its own seed list'}"
                if own else "") + "):", "",
             "| arm | seeds | mean R | same-findings R | probe AUC | samples to plain's final | ratio [95 %] |",
             "|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        c = arm.get("crossing") or {}
        ci = c.get("ratio_ci") or [None, None]
        lines.append(f"| {name} | {len(arm.get('final_mean_recall') or [])} | {_ci(arm.get('final_mean_recall'))} | "
                     f"{_ci(_final(arm, 'mean_recall_findings'))} | {_ci(_final(arm, 'probe_auc'))} | "
                     f"{_num(c.get('samples'), 0)} | {_num(c.get('ratio'))} [{_num(ci[0])}, {_upper(ci)}] |")
    plain = arms.get("plain", {}).get("final") or {}
    lines += ["", f"Chance mean R {_num(plain.get('chance_mean_recall'))}; the findings oracle's strict mean R "
                  f"(its ceiling) {_num(plain.get('oracle_mean_recall'))}. The teacher trained on "
                  f"{cost.get('teacher_train_samples')} samples of images the students never see: with them the "
                  f"reinforced arm's samples ratio is {_num(cost.get('reinforced_ratio_with_teacher'))}.", ""]
    lines += [f"- {b['bar']}: {_num(b.get('value'))}" + (f" [{_num(b['ci'][0])}, {_upper(b['ci'])}]"
                                                          if b.get("ci") else "") + f" — {_verdict(b.get('met'))}"
              for b in res.get("bars") or []]
    return lines


def gpu_efficiency() -> list[str]:
    """The GPU recipe's figures (issue 36) once its results.json is committed as docs/results/gpu-efficiency.json,
    each teacher on the report set beside chance and the train-box prior. A lease's partial results
    (docs/results/gpu-efficiency-partial.json, said so first) stand in while that file is absent, and come first
    when they ran the recipe as it stands and the whole results an earlier version of it."""
    whole = _load(GPU_EFFICIENCY) if GPU_EFFICIENCY.is_file() else None
    partial = _load(GPU_EFFICIENCY_PARTIAL) if GPU_EFFICIENCY_PARTIAL.is_file() else None
    if whole is None and partial is None:
        return ["*Not measured yet:* no GPU has run the recipe to the end, so `docs/results/gpu-efficiency.json` (its "
                "`results.json`) does not exist; once a GPU session commits it, `python scripts/headline.py --write` "
                "puts its table, bars and teacher here."]
    now = load_recipe(GPU_RECIPE)
    whole_drift, partial_drift = (recipe_drift(res["recipe"], now) if res and res.get("recipe") else ""
                                  for res in (whole, partial))
    lines: list[str] = []
    if partial is not None and (whole is None or (whole_drift and not partial_drift)):
        lines += [gpu_partial_lead(partial["partial"]), ""] + _gpu_block(partial, partial_drift)
        if whole is not None:
            lines += ["", "**The whole recipe, at an earlier version:**", ""]
    if whole is not None:
        lines += _gpu_block(whole, whole_drift)
    return lines


def _gpu_block(res: dict, drift: str) -> list[str]:
    """One GPU results file: the recipe keys it ran differently (``drift``, from ``recipe_drift``; empty: none),
    its efficiency table and bars, and its teachers."""
    lines = []
    if drift:  # the recipe changed since it ran: its figures are the earlier version's, said before them
        lines += [f"*Run at an earlier version of the recipe:* {drift}. The recipe as it stands has not run to its end on a GPU.",
                  ""]
    lines += efficiency(res, config="configs/experiments/gpu-efficiency.yaml") + [""]
    students = [run.get("final") or {} for runs in (res.get("runs") or {}).values() for run in runs]
    for name, teacher in (res.get("teachers") or {}).items():
        rep = teacher.get("report") or {}
        lines.append(f"- teacher {name} ({teacher.get('model')}, {teacher.get('steps')} steps) on the report set: "
                     f"mean R {_num(rep.get('mean_recall'))} (chance {_num(rep.get('chance_mean_recall'))}); "
                     f"PG z {_num(rep.get('pointing_z'))} (train-box prior "
                     f"{_train_prior(rep, students, 'train_prior_pointing_z')}); PG attention "
                     f"{_num(rep.get('pointing_attn'))} (train-box prior "
                     f"{_train_prior(rep, students, 'train_prior_pointing_attn')})")
    return lines


# recipe keys that change no figure: how often a run writes last.pt (a run resumed from any save is the run never
# interrupted; cxrdr.experiments.runs reuses finished runs whatever it was)
NOT_DRIFT = ("save_every",)


def recipe_drift(ran: dict, now: dict) -> str:
    """The recipe keys whose value differs between the recipe a results.json ran (``ran``) and the file now
    (``now``), each as "`key` ran (now value)", comma-joined; empty when they agree. Where the file was read from
    (``load_recipe``'s ``_path``) is no part of the recipe, nor are the ``NOT_DRIFT`` keys."""
    before, after = ({k: v for k, v in _leaves(tree) if not k.startswith("_") and k.rsplit(".", 1)[-1] not in NOT_DRIFT}
                     for tree in (ran, now))
    return ", ".join(f"`{key}` {before.get(key, '–')} (now {after.get(key, '–')})"
                     for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key))


def gpu_partial_lead(partial: dict) -> str:
    """The first line of partial GPU results: which lease, which runs, and what they may be read as."""
    return (f"*Partial results* (`train experiment efficiency --partial` after {GPU_PARTIAL_LEASE}: "
            f"`docs/results/gpu-efficiency-partial.json`). Finished runs: {seeds_by_arm(partial['finished'])}. "
            f"{partial_caveat(partial['left'])}")


def _train_prior(teacher_report: dict, students: list[dict], key: str) -> str:
    """A teacher's train-box prior on the report set: its own, else the students' (the same report images and
    boxes, the prior from the students' train split), said so."""
    if teacher_report.get(key) is not None:
        return _num(teacher_report[key])
    values = {s.get(key) for s in students} - {None}
    return f"{_num(values.pop())}, the students'" if len(values) == 1 else "–"


def _bar(res: dict, start: str) -> dict:
    return next(b for b in res["bars"] if b["bar"].startswith(start))


def derive_checks(res: dict, n_boot: int = 2000, seed: int = 0) -> dict:
    """The efficiency figure's fragility, from the committed per-seed curves: the ratio's interval when only
    plain's seeds are resampled (reinforced's seed-mean curve fixed; percentile bootstrap as
    ``stats.crossing_ratio``). Slow (seconds): written once to CHECKS with the source file's hash."""
    import numpy as np

    from cxrdr.experiments.stats import first_crossing, mean_curve

    metric = res.get("curve_metric", "mean_recall")
    plain = [r["curve"] for r in res["runs"]["plain"]]
    arm = mean_curve([r["curve"] for r in res["runs"]["reinforced"]], metric)
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(n_boot):
        p = mean_curve([plain[i] for i in rng.integers(0, len(plain), len(plain))], metric, with_ci=False)
        ax, px = first_crossing(arm, p["mean"][-1]), first_crossing(p, p["mean"][-1])
        if px:
            ratios.append(math.inf if ax is None else ax / px)
    lo, hi = np.percentile(ratios, [2.5, 97.5], method="inverted_cdf").tolist()
    return {"source": str(EFFICIENCY.relative_to(ROOT)), "source_sha256": _sha256(EFFICIENCY),
            "script": "scripts/headline.py --derive",
            "plain_only_bootstrap": {"ratio_ci": [lo, hi], "n_boot": len(ratios), "rng_seed": seed,
                                     "rule": "plain's seeds resampled with replacement, reinforced's seed-mean "
                                             "curve fixed; percentile interval"}}


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def efficiency_facts(res: dict) -> dict:
    """Every derived efficiency figure the prose quotes, computed from the results file."""
    arms, cost = res["arms"], res["cost"]
    fin = {a: (arms[a].get("final") or {}) for a in arms}
    cross = arms["reinforced"]["crossing"]
    xs, ys = arms["reinforced"]["curve_mean"]["xs"], arms["reinforced"]["curve_mean"]["mean"]
    after = next(i for i, y in enumerate(ys) if y >= cross["target"])
    teacher = next(iter(res["teachers"].values()))
    bench = res["bench_step_ms"]
    return {
        "ratio": cross["ratio"], "ratio_ci": cross["ratio_ci"], "over": cross["ratio"] - 1 / 3,
        "plain_x": cross["plain_samples"], "plain_last_x": arms["plain"]["curve_mean"]["xs"][-1],
        "every": res["recipe"]["efficiency"]["eval_every_samples"],
        "bracket_x": (xs[after - 1], xs[after]),
        "bracket": (xs[after - 1] / cross["plain_samples"], xs[after] / cross["plain_samples"]),
        "d_mean_r": fin["reinforced"]["mean_recall"] - fin["plain"]["mean_recall"],
        "d_findings": fin["reinforced"]["mean_recall_findings"] - fin["plain"]["mean_recall_findings"],
        "d_probe": fin["reinforced"]["probe_auc"] - fin["plain"]["probe_auc"],
        "teacher_steps": teacher["steps"], "teacher_step_ms": teacher["train_step_ms"],
        "teacher_wall_s": teacher["train_wall_s"], "add_teacher_s": teacher["add_teacher_seconds"],
        "teacher_samples": cost["teacher_train_samples"], "with_teacher": cost["reinforced_ratio_with_teacher"],
        "break_even": cost["break_even_runs"], "saving_s": cost["saving_per_run_s"],
        "break_even_with_training": (teacher["train_wall_s"] + cost["total_s"]) / cost["saving_per_run_s"],
        "bench_ratio": bench["reinforced"] / bench["plain"], "bench_steps": res["recipe"]["efficiency"][
            "step_benchmark"]["steps"], "online_ratio": bench["online"] / bench["reinforced"],
        "mean_step_ratio": fin["reinforced"]["step_ms"] / fin["plain"]["step_ms"],
        "mean_step_ms": (fin["plain"]["step_ms"], fin["reinforced"]["step_ms"]),
    }


def efficiency_reading(res: dict) -> list[str]:
    f, fin = efficiency_facts(res), {a: res["arms"][a]["final"] for a in res["arms"]}
    samples, quality = _bar(res, "reinforced reaches"), _bar(res, "reinforced final")
    online = res["arms"].get("online")
    return [
        f"**Efficiency: {'MET' if samples['met'] else 'MISSED'}** — reinforced reaches plain's final at "
        f"{f['ratio']:.3f} of plain's samples (limit 1/3: over by {f['over']:.3f}; upper 95 % {f['ratio_ci'][1]:.3f}, "
        f"limit 0.40). Its final quality gap over plain ({_signed(f['d_mean_r'], 2)} mean R, "
        f"{_signed(f['d_findings'], 2)} same-findings R, {_signed(f['d_probe'], 2)} probe AUC) passes the "
        f"2-sd bar ({_verdict(quality['met'])}). Plain on the students' *and* the teacher's images ends at "
        f"{fin['plain-more-data']['mean_recall']:.3f} vs plain's {fin['plain']['mean_recall']:.3f}. The online "
        f"teacher ({len(online['final_mean_recall'])} seeds) ends at {fin['online']['mean_recall']:.3f} vs stored "
        f"{fin['reinforced']['mean_recall']:.3f}, at {f['online_ratio']:.1f}x the step time. Counting the "
        f"teacher's {f['teacher_samples']:,} training samples: {f['with_teacher']:.2f}x."]


def efficiency_caveats(res: dict) -> list[str]:
    """What the efficiency figure does not control (issue 37), each with what the controls recipe measured."""
    f = efficiency_facts(res)
    checks = _load(CHECKS)["plain_only_bootstrap"]["ratio_ci"]
    first = _load(FIRST)
    fc = first["arms"]["reinforced"]["crossing"]
    shift = f["ratio"] - fc["ratio"]
    ctl = _load(CONTROLS)
    k = controls_facts(ctl)
    comp = k["comparisons"][("reinforced", "plain-minilm")]
    rein = k["arms"]["reinforced"]["crossings"]
    ctl_plain = k["arms"]["plain"]["crossing"]
    sr = k["step_ratio"]["reinforced"]
    return [
        "What the efficiency ratio does not control (issue 37), and what the controls recipe "
        "(`configs/experiments/cpu-demo-controls.yaml`, [results](results/cpu-demo-controls.json), "
        f"[details](experiments.md#controls-of-the-cpu-efficiency-figure-issue-37-part-3); fresh seeds "
        f"{ctl['seeds'][0]}–{ctl['seeds'][-1]}) measured for each:", "",
        "- *Text tower*: the teacher's text tower is pretrained MiniLM, the students' a tiny BERT from scratch; "
        "part of what reinforced gains may be the pretrained text space, which no plain arm here has. "
        f"*Controls*: plain with that pretrained tower ends at {k['fin']['plain-minilm']['mean_recall']:.3f} "
        f"({len(k['arms']['plain-minilm']['seeds'])} seeds, {len(_at_chance(k['arms']['plain-minilm']))} at "
        f"chance; lr not re-tuned) vs plain's {k['fin']['plain']['mean_recall']:.3f}; reinforced − it "
        f"{_signed(comp['gap'])} {_bounds(comp['gap_ci'])} ({_gap_reading(comp)}){_readme_tuned(k)}.",
        f"- *Plain's crossing is its own last evaluation* ({f['plain_x']:,.0f} samples"
        f"{'' if f['plain_x'] == f['plain_last_x'] else ' of ' + format(f['plain_last_x'], ',')}): "
        f"the target is plain's final value, so plain crosses earlier only if noise does. Resampling plain's "
        f"seeds alone (reinforced fixed) gives [{checks[0]:.3f}, {checks[1]:.3f}] "
        f"([cpu-demo-efficiency-checks.json](results/cpu-demo-efficiency-checks.json)). *Controls* "
        f"({len(k['arms']['plain']['seeds'])} plain seeds): plain first crosses at {ctl_plain['plain_samples']:,.0f} "
        f"samples ({'again its last evaluation' if ctl_plain['plain_samples'] == k['arms']['plain']['curve_mean']['xs'][-1] else 'before its last evaluation'}); the ratio is {_ratio_cell(rein[0])} at plain's final and "
        f"{_ratio_cell(rein[1])} / {_ratio_cell(rein[2])} at 95 % / 90 % of it.",
        f"- *Evaluations are {f['every']} samples apart*: reinforced's seed-mean curve crosses between "
        f"{f['bracket_x'][0]:,} and {f['bracket_x'][1]:,} samples, so before interpolation the ratio is anywhere "
        f"in ({f['bracket'][0]:.3f}, {f['bracket'][1]:.3f}]. *Controls*: every "
        f"{ctl['recipe']['efficiency']['eval_every_samples']} samples.",
        f"- *The teacher's compute is not in the cost table*: {f['teacher_steps']} steps at "
        f"{f['teacher_step_ms']:,.0f} ms, {f['teacher_wall_s']:.0f} s of training + {f['add_teacher_s']:.0f} s to "
        f"add it to the shards. The table's break-even ({f['break_even']:.2f} training runs) counts only the "
        f"adding; with the training it is {f['break_even_with_training']:.2f} runs. *Controls*: the cost table "
        f"counts it, {k['cost']['teacher_compute_s']:.0f} s = "
        f"{k['cost']['teacher_compute_s'] / k['plain_run_s']:.1f} plain runs.",
        f"- *\"Stored step {f['bench_ratio']:.2f}x\"* is the interleaved benchmark's median of "
        f"{f['bench_steps']} steps; the runs' own mean steps ({f['mean_step_ms'][1]:.0f} vs "
        f"{f['mean_step_ms'][0]:.0f} ms) give {f['mean_step_ratio']:.2f}x, over the bar's 1.05x. *Controls*: "
        f"{sr['bench_ratio']:.2f}x by the benchmark, {sr['runs_ratio']:.2f}x by the runs.",
        f"- *A first measurement* of the same recipe, run configs and seeds ({FIRST_DATE}, commit "
        f"{FIRST_COMMIT}, [kept](results/superseded/cpu-demo-efficiency-00389eb.json)) gave "
        f"{fc['ratio']:.3f} [{fc['ratio_ci'][0]:.3f}, {fc['ratio_ci'][1]:.3f}] (plain's final mean R "
        f"{first['arms']['plain']['final']['mean_recall']:.3f}); re-run on the code of commit {SECOND_COMMIT} "
        f"(shards and teacher built anew) it gave {f['ratio']:.3f}: the code version alone moved the ratio by "
        f"{_signed(shift)}, about its {f['over']:.3f} margin over the bar. The second is the one reported."]


def _bars_line(res: dict) -> str:
    return "; ".join(f"{b['bar']}: {_num(b.get('value'))} {_verdict(b.get('met'))}" for b in res["bars"]
                     if b.get("met") is not None)


def readme_efficiency(res: dict) -> list[str]:
    """The README's efficiency headline: the table, every judged bar, the reading and what is not controlled."""
    f = efficiency_facts(res)
    checks = _load(CHECKS)["plain_only_bootstrap"]["ratio_ci"]
    fc = _load(FIRST)["arms"]["reinforced"]["crossing"]
    table = efficiency(res)
    head = table.index("")
    rows = table[head + 1: table.index("", head + 1)]
    chance = res["arms"]["plain"]["final"]["chance_mean_recall"]
    return ([f"**Efficiency** (`train experiment efficiency --config configs/experiments/cpu-demo.yaml`; seeds "
             f"{res['seeds'][0]}–{res['seeds'][-1]}, online and plain-more-data on their own; chance mean R "
             f"{chance:.3f}):", ""] + rows + ["", f"Bars: {_bars_line(res)}.", ""] + efficiency_reading(res) + [
        "Not controlled in this run ([docs/protocol.md](docs/protocol.md#re-measured-headlines)): the teacher's "
        f"text tower is pretrained, the students' from scratch; plain's crossing is its own last evaluation "
        f"(resampling plain alone: [{checks[0]:.3f}, {checks[1]:.3f}]); evaluations {f['every']} samples apart "
        f"leave the crossing anywhere in ({f['bracket'][0]:.3f}, {f['bracket'][1]:.3f}]; the runs' own mean steps "
        f"give {f['mean_step_ratio']:.2f}x, not {f['bench_ratio']:.2f}x. A first measurement on older code "
        f"(commit {FIRST_COMMIT}) gave {fc['ratio']:.3f} [{fc['ratio_ci'][0]:.3f}, {fc['ratio_ci'][1]:.3f}]. "
        + readme_controls(_load(CONTROLS))])


# --------------------------------------------------------------------------- efficiency controls (issue 37 part 3)


def _ratio_cell(c: dict | None) -> str:
    if not c:
        return "n/a"
    lo, hi = c.get("ratio_ci") or [None, None]
    # an upper end stored as null (JSON has no inf) with a lower one: some resamples never reach the target
    return f"{_num(c.get('ratio'))} [{_num(lo)}, {'∞' if hi is None and lo is not None else _num(hi)}]"


def _pooled(res: dict, arm: str, figure: str) -> dict | None:
    """An arm's pooled margin over the train-box prior (results' margins_over_train_prior), None without one."""
    return ((res.get("margins_over_train_prior") or {}).get(arm) or {}).get(figure)


def _pooled_cell(res: dict, arm: str, figure: str) -> str:
    m = _pooled(res, arm, figure)
    return "n/a" if not m else f"{_signed(m['margin'])} {_bounds(m['interval'])}"


def _at_chance(arm: dict) -> list[tuple[int, float]]:
    """(seed, final mean R) of the seeds that ended at chance: below twice the chance mean R."""
    chance = (arm.get("final") or {}).get("chance_mean_recall") or 0
    return [(s, v) for s, v in zip(arm["seeds"], arm["final_mean_recall"]) if v < 2 * chance]


def controls_facts(res: dict) -> dict:
    arms = {name: dict(arm, seeds=[r["seed"] for r in res["runs"][name]]) for name, arm in res["arms"].items()}
    fin = {a: arms[a]["final"] for a in arms}
    cost, teacher = res["cost"], next(iter(res["teachers"].values()))
    probe = _load(CONTROLS_PROBE) if "plain-minilm-tuned" in arms and CONTROLS_PROBE.is_file() else None
    return {"arms": arms, "fin": fin, "cost": cost, "teacher": teacher, "probe": probe,
            "comparisons": {(c["arm"], c["against"]): c for c in res.get("comparisons") or []},
            "minilm_vs_plain": gap_interval(arms["plain-minilm"]["final_mean_recall"],
                                            arms["plain"]["final_mean_recall"]),
            "plain_run_s": fin["plain"]["wall_s"], "step_ratio": res["step_ratio"]}


def controls_table(res: dict) -> list[str]:
    """Every arm of the controls recipe: finals, the samples ratio at three targets, step and pointing margins."""
    f = controls_facts(res)
    fracs = res["target_fractions"]
    chance = f["fin"]["plain"]["chance_mean_recall"]
    lines = [f"**Controls** (`train experiment efficiency --config configs/experiments/cpu-demo-controls.yaml`; "
             f"report set `{res['protocol']['report_shards']}`; fresh seeds {res['seeds'][0]}–{res['seeds'][-1]}; "
             f"evaluations every {res['recipe']['efficiency']['eval_every_samples']} samples; chance mean R "
             f"{chance:.3f}; [95 %]: t-interval over seeds, bootstrap over seeds for the ratios, over report images "
             "and seeds for the pointing margins):", "",
             "| arm | seeds | mean R | same-findings R | probe AUC | "
             + " | ".join(f"samples ratio at {round(100 * x)} % of plain's final" for x in fracs)
             + " | loop step ms | PG z − train prior | PG attn − train prior |",
             "|---|---|---|---|---|" + "---|" * len(fracs) + "---|---|---|"]
    for name, arm in f["arms"].items():
        crossings = arm.get("crossings") or [arm.get("crossing")]
        lines.append(f"| {name} | {len(arm['seeds'])} | {_ci(arm['final_mean_recall'])} | "
                     f"{_ci(_final(arm, 'mean_recall_findings'))} | {_ci(_final(arm, 'probe_auc'))} | "
                     + " | ".join(_ratio_cell(c) for c in crossings)
                     + f" | {_num(arm['final'].get('step_ms'), 0)} | {_pooled_cell(res, name, 'pointing_z')} | "
                     f"{_pooled_cell(res, name, 'pointing_attn')} |")
    per_seed = "; ".join(f"{name} " + ", ".join(f"{s}: {v:.3f}" for s, v in zip(arm["seeds"], arm["final_mean_recall"]))
                         for name, arm in f["arms"].items())
    return lines + ["", f"Final mean R per seed (seed: value): {per_seed}."]


def _gap_reading(gap: dict) -> str:
    lo, hi = gap["gap_ci"]
    return ("above it: the interval excludes 0" if lo > 0 else "below it: the interval excludes 0" if hi < 0
            else "not shown: the interval includes 0")


def controls_reading(res: dict) -> list[str]:
    """What the controls show: reinforced against the pretrained-text plain arm, the cost with the teacher."""
    f = controls_facts(res)
    fin, cost, sr = f["fin"], f["cost"], f["step_ratio"]
    c = f["comparisons"][("reinforced", "plain-minilm")]
    mvp = f["minilm_vs_plain"]
    rein = f["arms"]["reinforced"]
    targets = ", ".join(f"{round(100 * x.get('fraction', 1.0))} % {_ratio_cell(x)}" for x in c["crossings"])
    plain_targets = (" / ".join(str(round(100 * x.get("fraction", 1.0))) for x in rein["crossings"])
                     + " % of plain's final: " + ", ".join(_ratio_cell(x) for x in rein["crossings"]))
    minilm = f["arms"]["plain-minilm"]
    collapsed = _at_chance(minilm)
    collapse = (f"; {len(collapsed)} of its {len(minilm['seeds'])} seeds ended at chance ("
                + ", ".join(f"seed {s}: {v:.3f}" for s, v in collapsed) + ")") if collapsed else ""
    samples = _bar(res, "reinforced reaches")
    return [
        f"**Controls.** A plain arm whose text tower starts from the teacher's pretrained MiniLM (plain-minilm, "
        f"plain's lr {res['recipe']['efficiency']['train']['optim']['lr']:g}, not re-tuned) ends at "
        f"{fin['plain-minilm']['mean_recall']:.3f} mean R against plain's {fin['plain']['mean_recall']:.3f} "
        f"({_signed(mvp['gap'])} {_bounds(mvp['gap_ci'])}, Welch{collapse}). Reinforced ends "
        f"{_signed(c['gap'])} {_bounds(c['gap_ci'])} above plain-minilm ({_gap_reading(c)}) and reaches "
        f"plain-minilm's own final at {_ratio_cell(c['crossings'][0])} of plain-minilm's samples. Against plain "
        f"({len(f['arms']['plain']['seeds'])} seeds, evaluations every "
        f"{res['recipe']['efficiency']['eval_every_samples']} samples) the samples ratio at {plain_targets}; "
        f"the bar (≤ 1/3, upper 95 % ≤ 0.40) is {_verdict(samples['met'])}. Teacher compute "
        f"{cost['teacher_compute_s']:.0f} s (training {cost['teacher_train_wall_s']:.0f} s + embedding "
        f"{cost['total_s']:.0f} s) = {cost['teacher_compute_s'] / f['plain_run_s']:.1f} plain runs of "
        f"{f['plain_run_s']:.0f} s. Reinforced's step over plain's: {sr['reinforced']['bench_ratio']:.2f}x by the "
        f"interleaved benchmark, {sr['reinforced']['runs_ratio']:.2f}x by the runs' own mean steps; plain-minilm "
        f"steps at {sr['plain-minilm']['runs_ratio']:.1f}x plain's (MiniLM's 6 layers on one CPU thread)."
        + controls_tuned(f)]


def _probe_text(probe: dict) -> str:
    runs = probe["runs"].values()
    return ", ".join(f"{r['lr']:g}: " + (f"{r['final_mean_recall']:.3f}" if "final_mean_recall" in r else
                                         f"{r['last_mean_recall']:.3f} when stopped at step {r['stopped_at']}")
                     for r in runs)


def controls_tuned(f: dict) -> str:
    """The pretrained-text plain arm at its val-chosen lr, when the results hold it ('' otherwise)."""
    if "plain-minilm-tuned" not in f["arms"]:
        return ""
    arm = f["arms"]["plain-minilm-tuned"]
    c = f["comparisons"][("reinforced", "plain-minilm-tuned")]
    probe = f["probe"]
    return (f" **With its own lr**, chosen on val by a seed-0 probe (final val mean R at lr {_probe_text(probe)}; "
            f"chosen {probe['chosen_lr']:g}, after plain-minilm's report runs had been read), plain-minilm-tuned ends "
            f"at {_ci(arm['final_mean_recall'])} ({len(arm['seeds'])} seeds: "
            + ", ".join(f"{v:.3f}" for v in arm["final_mean_recall"]) + f"); reinforced − it {_signed(c['gap'])} "
            f"{_bounds(c['gap_ci'])} ({_gap_reading(c)}), and reinforced "
            + (f"reaches its final at {_ratio_cell(c['crossings'][0])} of its samples" if c["crossings"][0]["ratio"]
               else "never reaches its final") + f". plain-minilm-tuned reaches plain's final at "
            f"{_ratio_cell(arm['crossings'][0])} of plain's samples (reinforced: "
            f"{_ratio_cell(f['arms']['reinforced']['crossings'][0])}), but each of its steps costs "
            f"{f['step_ratio']['plain-minilm-tuned']['bench_ratio']:.1f}x plain's by the interleaved benchmark "
            f"(reinforced's {f['step_ratio']['reinforced']['bench_ratio']:.2f}x): a pretrained text tower buys "
            f"more than the distillation here, per sample; per CPU second the tiny-tower student is far cheaper.")


def _readme_tuned(f: dict) -> str:
    if "plain-minilm-tuned" not in f["arms"]:
        return ""
    arm, c = f["arms"]["plain-minilm-tuned"], f["comparisons"][("reinforced", "plain-minilm-tuned")]
    return (f"; at its val-chosen lr {f['probe']['chosen_lr']:g} it ends at {_ci(arm['final_mean_recall'])} "
            f"({len(arm['seeds'])} seeds) and reinforced − it is {_signed(c['gap'])} {_bounds(c['gap_ci'])} "
            f"({_gap_reading(c)})")


def _seed_finals(res: dict, arm: str) -> dict[int, float]:
    """seed -> final mean R of one arm of an efficiency results file."""
    return dict(zip((r["seed"] for r in res["runs"][arm]), res["arms"][arm]["final_mean_recall"]))


def _seed_mean_at(res: dict, arm: str, samples: int) -> float | None:
    """An arm's seed-mean curve value at an evaluation point (None where a seed has no evaluation there)."""
    values = [next((p["mean_recall"] for p in run["curve"] if p["samples_seen"] == samples), None)
              for run in res["runs"][arm]]
    return None if None in values else sum(values) / len(values)


def _paired_seeds(a: dict[int, float], b: dict[int, float]) -> dict:
    """Seed-by-seed differences a - b over the seeds both hold, with their t interval."""
    seeds = [s for s in a if s in b]
    diffs = [a[s] - b[s] for s in seeds]
    mean, half = t_interval(diffs)
    return {"seeds": seeds, "diffs": diffs, "gap": mean, "gap_ci": None if half is None else [mean - half, mean + half]}


def reinforced_minilm_facts(res: dict, ctl: dict, name: str = "reinforced-minilm") -> dict:
    """The reinforced arm with the pretrained text tower against plain-minilm-tuned trained again beside it
    (cpu-demo-controls-reinforced-minilm): paired seed by seed (the same seeds, shards and report set), the one
    crossing rule of its results' comparison, and beside them the controls' own plain-minilm-tuned and the set-up's
    check (the teacher made again from the same seeds: its own-test mean R beside the controls'). ``name``: the
    distilled arm (another distillation setting of the same recipe, e.g. the val probe's choice)."""
    arm, ref = _seed_finals(res, name), _seed_finals(res, "plain-minilm-tuned")
    budget = max(point["samples_seen"] for run in res["runs"]["plain-minilm-tuned"] for point in run["curve"])
    paired = _paired_seeds(arm, ref)
    own = lambda r: next(iter(r["teachers"].values()))["own_test"]["mean_recall"]  # noqa: E731
    def step(arm_name: str) -> float:
        runs = res["runs"][arm_name]
        return sum(r["train_summary"]["mean_step_ms"] for r in runs) / len(runs)

    comparison = next((c for c in res.get("comparisons") or []
                       if (c["arm"], c["against"]) == (name, "plain-minilm-tuned")), None)
    return {"arm": arm, "ref": ref, "seeds": paired["seeds"], "diffs": paired["diffs"],
            "paired": paired,
            "crossings": (comparison or {}).get("crossings") or [],
            "welch": {k: (comparison or {}).get(k) for k in ("gap", "gap_ci")},
            "controls_tuned": ctl["arms"]["plain-minilm-tuned"]["final_mean_recall"],
            "teacher_own": own(res), "teacher_own_controls": own(ctl), "controls_commit": next(iter(
                ctl["teachers"].values()))["code"]["commit"][:7],
            "lr": res["recipe"]["efficiency"]["runs"][name]["optim"]["lr"],
            "step_ms": step(name), "tuned_step_ms": step("plain-minilm-tuned"),
            "early": {x: {arm_name: _seed_mean_at(res, arm_name, x) for arm_name in (name, "plain-minilm-tuned")}
                      for x in (budget // 4, budget // 2)}}


def _paired_text(g: dict) -> str:
    """A seed-by-seed difference (``_paired_seeds``) with its interval and what it shows."""
    how = f"paired by seed, t over {len(g['seeds'])} seeds"
    return f"{_signed(g['gap'])} {_gap_text(g, how)}"


def _gap_text(gap: dict, how: str) -> str:
    """A difference's interval and what it shows, or that one seed gives none."""
    if not gap.get("gap_ci"):
        return "(one seed: no interval)"
    return f"{_bounds(gap['gap_ci'])} ({how}; {_gap_reading(gap)})"


def _reach_text(f: dict, name: str) -> str:
    """An arm's samples to reach fractions of plain-minilm-tuned's final, over plain-minilm-tuned's own (the one
    crossing rule of the results' comparison)."""
    if not f["crossings"]:
        return "its crossing of plain-minilm-tuned's final: not computed"
    return (f"{name}'s samples to reach " + ", ".join(f"{round(100 * c.get('fraction', 1.0))} %" for c in f["crossings"])
            + " of plain-minilm-tuned's final, over plain-minilm-tuned's own: "
            + ", ".join(_ratio_cell(c) + ("" if c.get("ratio") else " (never)") for c in f["crossings"]))


def controls_reinforced_minilm(res: dict, ctl: dict) -> list[str]:
    """docs/experiments.md's paragraph on the controls' missing cell: distillation on top of a pretrained text tower."""
    f = reinforced_minilm_facts(res, ctl)
    per_seed = ", ".join(f"{s}: {f['arm'][s]:.3f} vs {f['ref'][s]:.3f}" for s in f["seeds"])
    paired = _gap_text(f["paired"], f"t over {len(f['seeds'])} seeds")
    same = ("the same teacher" if abs(f["teacher_own"] - f["teacher_own_controls"]) < 1e-9 else
            f"another teacher than the controls' (code {f['controls_commit']}), so plain-minilm-tuned was trained "
            "again beside it rather than read from the controls")
    below = sum(d < 0 for d in f["diffs"])
    early = ""  # the curves early on, where each arm has an evaluation at a quarter and half of the budget
    if all(None not in v.values() for v in f["early"].values()):
        quarter = next(iter(f["early"].values()))
        shape = (("leads" if quarter["reinforced-minilm"] > quarter["plain-minilm-tuned"] else "trails")
                 + " at a quarter of the budget and ends " + ("lower" if f["paired"]["gap"] < 0 else "higher")
                 + " on every seed" * (below in (0, len(f["seeds"]))))
        early = (" Read from the curves after seeing them (not a comparison set beforehand), the seed means at "
                 + "; ".join(f"{x:,} samples: reinforced-minilm {_num(v['reinforced-minilm'])}, plain-minilm-tuned "
                             f"{_num(v['plain-minilm-tuned'])}" for x, v in f["early"].items())
                 + f": the distilled student {shape}.")
    reach = _reach_text(f, "reinforced-minilm")
    welch = ("" if not f["welch"].get("gap_ci") else
             f" (the experiment's own table, Welch over the two arms' seeds: {_signed(f['welch']['gap'])} "
             f"{_bounds(f['welch']['gap_ci'])})")
    return [
        f"**Distillation on top of the pretrained text tower** (stop 73; `train experiment efficiency --config "
        f"configs/experiments/cpu-demo-controls-reinforced-minilm.yaml`, [results](results/{CONTROLS_MINILM.name})). "
        f"No arm above had both the stored teacher and the pretrained text tower, which is how the GPU recipe's "
        f"students train. reinforced-minilm is the reinforced arm with the students' text tower started from the "
        f"pretrained MiniLM, at plain-minilm-tuned's val-chosen lr {f['lr']:g} (not re-probed for this arm: an lr "
        f"tuned for the plain arm, not for this one); plain-minilm-tuned is trained beside it on the same seeds "
        f"{f['seeds'][0]}–{f['seeds'][-1]}, shards and report set. The set-up made again from the controls' seeds "
        f"with this code gave {same} (the teacher's own-test mean R {f['teacher_own']:.3f} against the controls' "
        f"{f['teacher_own_controls']:.3f}). reinforced-minilm ends at {_ci(list(f['arm'].values()))}, "
        f"plain-minilm-tuned at {_ci(list(f['ref'].values()))} (the controls' run of it: {_ci(f['controls_tuned'])}); "
        f"seed by seed ({per_seed}: {below} of {len(f['seeds'])} below) the paired difference is "
        f"{_signed(f['paired']['gap'])} {paired}{welch}. By the one crossing rule, {reach}.{early} The runs' mean "
        f"steps, two side by side on the 2-core box: {f['step_ms']:.0f} ms and {f['tuned_step_ms']:.0f} ms."]


def controls_distill_probe(probe: dict, res: dict, ctl: dict) -> list[str]:
    """docs/experiments.md's paragraph on the val probe of reinforced-minilm's distillation terms, and (once the
    recipe holds it) the chosen setting's report-set runs against plain-minilm-tuned, paired by seed."""
    finals = "; ".join(f"{label} {run['final_mean_recall']:.3f}" if "final_mean_recall" in run else
                       f"{label} {run['last_mean_recall']:.3f} when stopped at step {run['stopped_at']}"
                       for label, run in probe["runs"].items())
    chosen, best = probe["chosen"], probe.get("best")
    ahead = _signed(probe["best_ahead_of_current"]) if best else ""
    if best == "current":
        verdict = "the current setting ends highest and stays"
    elif chosen == best:
        verdict = f"{best} ends highest, ahead of the current setting by {ahead}, and replaces it"
    else:
        verdict = (f"{best} ends highest, ahead of the current setting by {ahead}, not more than the margin: the "
                   f"current setting stays")
    finished = {k: r["final_mean_recall"] for k, r in probe["runs"].items() if "final_mean_recall" in r}
    runner_up = max((k for k in finished if k != best), key=finished.get, default=None)
    if best and runner_up not in (None, "current") and finished[best] - finished[runner_up] <= probe["margin"]:
        verdict += (f" ({runner_up} ends {finished[best] - finished[runner_up]:.3f} below it, within the margin: one "
                    f"seed on 95 studies does not tell those two apart, and the rule takes the highest)")
    lines = [
        f"**The distillation terms chosen on val** (stop 74; `python scripts/controls_probe.py configs distill`, the "
        f"four `train run`s, `... summary distill`: [results](results/{DISTILL_PROBE.name})). reinforced-minilm's "
        f"run config with the GPU probe's first four reinforced settings (the current λ 1 with affinity and feature "
        f"at 50; KL only; both terms at 5; λ 0.5), seed 0, final mean R on the training shards' val split (95 "
        f"studies): {finals}. The rule, the GPU probe's, written before any run: {probe['rule']}. Here {verdict}."]
    arm = f"reinforced-minilm-{chosen}"
    if chosen != "current" and arm in res["runs"]:
        f = reinforced_minilm_facts(res, ctl, arm)
        per_seed = ", ".join(f"{s}: {f['arm'][s]:.3f} vs {f['ref'][s]:.3f}" for s in f["seeds"])
        how = f"t over {len(f['seeds'])} seeds"
        lines[0] += (f" On the report set, trained on seeds {f['seeds'][0]}–{f['seeds'][-1]} (no choice read them) "
                     f"beside the plain-minilm-tuned runs above, {arm} ends at {_ci(list(f['arm'].values()))}; seed "
                     f"by seed ({per_seed}) the paired difference is {_signed(f['paired']['gap'])} "
                     f"{_gap_text(f['paired'], how)}. By the same crossing rule, {_reach_text(f, arm)}. Its runs "
                     f"trained three side by side on the 2-core box (the two arms above: two), so their mean step, "
                     f"{f['step_ms']:.0f} ms, is no cost figure.")
    elif chosen != "current":
        lines[0] += f" Its report-set runs ({arm}) are not made yet."
    return lines


def _readme_minilm(ctl: dict) -> str:
    """The README's clause on reinforced-minilm, once its results are committed ('' before)."""
    if not CONTROLS_MINILM.is_file():
        return ""
    res = _load(CONTROLS_MINILM)
    f = reinforced_minilm_facts(res, ctl)
    text = (f"; with the pretrained text tower too, reinforced − plain-minilm-tuned (both trained again, seeds "
            f"{f['seeds'][0]}–{f['seeds'][-1]}) is {_signed(f['paired']['gap'])} "
            f"{_gap_text(f['paired'], 'paired by seed')}")
    chosen = _load(DISTILL_PROBE)["chosen"] if DISTILL_PROBE.is_file() else "current"
    if f"reinforced-minilm-{chosen}" in res["runs"]:  # the val probe's distillation setting, on the same seeds
        g = reinforced_minilm_facts(res, ctl, f"reinforced-minilm-{chosen}")
        text += (f", and at the distillation setting chosen on val ({chosen}) {_signed(g['paired']['gap'])} "
                 f"{_gap_text(g['paired'], 'paired by seed')}")
    return text


def _report_mean_r(res: dict, teachers: dict) -> float:
    """The report-set mean R of a results file's (first) stored teacher, from both teachers' `train eval` file."""
    return teachers["teachers"][next(iter(res["teachers"]))]["summary"]["mean_recall"]


def strong_teacher_facts(res: dict, ctl: dict, teachers: dict) -> dict:
    """cpu-demo-controls-strong-teacher against the controls: both teachers on the report set (the same `train eval`
    of each checkpoint), the arms' finals, reinforced paired seed by seed with the controls' reinforced (the weaker
    teacher), with plain-minilm-tuned and with this recipe's plain, the samples ratio and the teacher's cost."""
    arms = res["arms"]
    finals = {arm: _seed_finals(res, arm) for arm in res["runs"]}
    strong = finals["reinforced"]
    report = {name: t["summary"]["mean_recall"] for name, t in teachers["teachers"].items()}
    return {"finals": finals, "report": report, "weak": report["lite2-s1"],
            "strong": _report_mean_r(res, teachers),
            "vs_weak": _paired_seeds(strong, _seed_finals(ctl, "reinforced")),
            "vs_tuned": _paired_seeds(strong, _seed_finals(ctl, "plain-minilm-tuned")),
            "vs_plain": _paired_seeds(strong, finals["plain"]),
            "bridge": _paired_seeds(finals["plain"], _seed_finals(ctl, "plain")),
            "crossings": arms["reinforced"]["crossings"], "teacher": next(iter(res["teachers"].values())),
            "cost": res["cost"], "plain_run_s": arms["plain"]["final"]["wall_s"],
            "ctl_reinforced": ctl["arms"]["reinforced"]["final_mean_recall"],
            "ctl_tuned": ctl["arms"]["plain-minilm-tuned"]["final_mean_recall"]}


def controls_strong_teacher(res: dict, ctl: dict, teachers: dict) -> list[str]:
    """docs/experiments.md's paragraph on the controls with a teacher above its students."""
    f = strong_teacher_facts(res, ctl, teachers)
    t, cost, fin = f["teacher"], f["cost"], f["finals"]
    seeds = f["vs_weak"]["seeds"]

    def studies(recipe: dict) -> int:
        return int(recipe["teachers"]["build"]["source"].split(":")[1])
    lo, hi = f["bridge"]["gap_ci"]
    bridge = ": the code moved nothing resolvable" if lo <= 0 <= hi else ": the code moved plain's final"
    total = fin.get("plain-total-samples")
    total_text = ("" if not total else
                  f" Plain trained for the students' samples plus the teacher's ({t['train_samples']:,} more, "
                  f"{len(total)} seeds), on the students' set, ends at {_ci(list(total.values()))}: what the "
                  f"teacher's samples would buy plain instead.")
    return [
        f"**A teacher above its students** (stop 76; `train experiment efficiency --config "
        f"configs/experiments/cpu-demo-controls-strong-teacher.yaml`, [results](results/{CONTROLS_STRONG.name}); both "
        f"teachers on the report set: [results](results/{TEACHER_REPORT.name})). The controls' teacher scores report-set "
        f"mean R {f['weak']:.3f}, below the students it teaches (reinforced {_ci(f['ctl_reinforced'])}, "
        f"plain-minilm-tuned {_ci(f['ctl_tuned'])}): MobileCLIP's premise, a teacher well above its students, does not "
        f"hold there. This recipe changes the teacher and nothing else: the same model and objective on "
        f"{studies(res['recipe']) // studies(ctl['recipe'])}x its studies for {t['steps']} steps ({t['train_samples']:,} samples, {t['train_wall_s']:.0f} s on both cores), "
        f"report-set mean R {f['strong']:.3f}; the students' shards the controls' own samples (a build of their "
        f"own, checked member by member), the same report set and seeds {seeds[0]}–{seeds[-1]}. Plain, trained "
        f"again on this code, ends at {_ci(list(fin['plain'].values()))} (against the controls' plain on the same "
        f"seeds {_paired_text(f['bridge'])}{bridge}); reinforced ends at "
        f"{_ci(list(fin['reinforced'].values()))}, above its teacher-weak twin of the controls by {_paired_text(f['vs_weak'])}, "
        f"above plain-minilm-tuned (the controls' best arm, seeds {f['vs_tuned']['seeds'][0]}–"
        f"{f['vs_tuned']['seeds'][-1]}, trained on the controls' code) by {_paired_text(f['vs_tuned'])}, and above this plain by {_paired_text(f['vs_plain'])}. By "
        f"the one crossing rule it reaches plain's final at {_ratio_cell(f['crossings'][0])} of plain's samples, "
        f"95 % of it at {_ratio_cell(f['crossings'][1])} (the CPU bar: at most 1/3, upper 95 % at most 0.40)."
        f"{total_text} What it buys is retrieval, not pointing: PG z − train-box prior (report set, over images and "
        f"seeds) reinforced {_pooled_cell(res, 'reinforced', 'pointing_z')}, plain "
        f"{_pooled_cell(res, 'plain', 'pointing_z')}; PG attention − prior reinforced "
        f"{_pooled_cell(res, 'reinforced', 'pointing_attn')}, plain {_pooled_cell(res, 'plain', 'pointing_attn')}."
        f" The teacher's compute is {cost['teacher_compute_s']:.0f} s "
        f"({cost['teacher_compute_s'] / f['plain_run_s']:.1f} plain runs); counting its training samples in, "
        f"reinforced needs {cost['reinforced_ratio_with_teacher']:.2f}x plain's samples: the saving is per student "
        f"trained from the stored shards, as MobileCLIP's is, not for the first one."]


def _readme_strong(ctl: dict) -> str:
    """The README's clause on the stronger teacher, once its results are committed ('' before)."""
    if not (CONTROLS_STRONG.is_file() and TEACHER_REPORT.is_file()):
        return ""
    f = strong_teacher_facts(_load(CONTROLS_STRONG), ctl, _load(TEACHER_REPORT))
    return (f"; with a teacher above its students (report-set mean R {f['strong']:.3f} against the controls' "
            f"{f['weak']:.3f}; nothing else changed), reinforced ends at {_ci(list(f['finals']['reinforced'].values()))} "
            f"against plain's {_ci(list(f['finals']['plain'].values()))} and reaches plain's final at "
            f"{_ratio_cell(f['crossings'][0])} of plain's samples")


STRONG_MINILM_ARMS = ("reinforced-minilm-lambda-0.5", "reinforced-minilm")  # the val probe's setting first


def _bridge_text(g: dict) -> str:
    """A bridge's paired difference; runs equal on every seed say so rather than print a zero-width interval."""
    if g["diffs"] and all(d == 0 for d in g["diffs"]):
        return f"equal on all {len(g['diffs'])} seeds: the same runs"
    return _paired_text(g)


def strong_minilm_facts(res: dict, weak: dict) -> dict:
    """cpu-demo-controls-strong-teacher-minilm: each distilled MiniLM arm against plain-minilm-tuned trained beside
    it (``reinforced_minilm_facts``), and against the same arm with the weaker teacher
    (cpu-demo-controls-reinforced-minilm, ``weak``), paired seed by seed; the bridge: plain-minilm-tuned here
    minus its run there, on the same seeds."""
    arms = {name: reinforced_minilm_facts(res, weak, name) for name in STRONG_MINILM_ARMS if name in res["runs"]}
    for name, f in arms.items():
        f["vs_weak"] = _paired_seeds(f["arm"], _seed_finals(weak, name))
    ref = _seed_finals(res, "plain-minilm-tuned")
    return {"arms": arms, "ref": ref, "bridge": _paired_seeds(ref, _seed_finals(weak, "plain-minilm-tuned"))}


def controls_strong_minilm(res: dict, weak: dict, teachers: dict) -> list[str]:
    """docs/experiments.md's paragraph on the stronger teacher distilled into students with the pretrained text
    tower (the GPU recipe's students' set-up); ``teachers``: both teachers' report-set `train eval`."""
    f = strong_minilm_facts(res, weak)
    report = _report_mean_r(res, teachers)
    first = next(iter(f["arms"].values()))
    seeds = first["seeds"]
    lines = [
        f"**The stronger teacher with MiniLM students** (stop 77; `train experiment efficiency --config "
        f"configs/experiments/cpu-demo-controls-strong-teacher-minilm.yaml`, "
        f"[results](results/{CONTROLS_STRONG_MINILM.name})). The cell closest to the GPU recipe's students: a "
        f"teacher well above them (the stronger teacher above: report-set mean R {report:.3f}) and "
        f"a text tower started from the pretrained MiniLM. The arms are the two above's, unchanged (lr "
        f"{first['lr']:g}; no setting re-chosen for this teacher), on its shards, seeds {seeds[0]}–{seeds[-1]}. "
        f"plain-minilm-tuned, trained again beside them, ends at {_ci(list(f['ref'].values()))} (its run on the "
        f"weaker teacher's shards, same seeds: {_bridge_text(f['bridge'])})."]
    for name, a in f["arms"].items():
        per_seed = ", ".join(f"{s}: {a['arm'][s]:.3f} vs {a['ref'][s]:.3f}" for s in a["seeds"])
        setting = "λ 0.5, the val probe's choice" if name.endswith("lambda-0.5") else (
            "λ 1, the GPU recipe's weights; added after seed 20 of the other arms had been read")
        lines[0] += (f" {name} ({setting}) ends at {_ci(list(a['arm'].values()))}; against plain-minilm-tuned, "
                     f"seed by seed ({per_seed}), {_paired_text(a['paired'])}; against the same arm with the weaker "
                     f"teacher {_paired_text(a['vs_weak'])}. By the one crossing rule, {_reach_text(a, name)}.")
    margins = "; ".join(f"{arm} PG z {_pooled_cell(res, arm, 'pointing_z')}, attention "
                        f"{_pooled_cell(res, arm, 'pointing_attn')}"
                        for arm in (*f["arms"], "plain-minilm-tuned"))
    lines[0] += (f" What the teacher buys is retrieval again, not pointing: each minus the train-box prior (report "
                 f"set, over images and seeds): {margins}.")
    return lines


def _readme_strong_minilm() -> str:
    """The README's clause on the stronger teacher with MiniLM students, once its results are committed."""
    if not (CONTROLS_STRONG_MINILM.is_file() and CONTROLS_MINILM.is_file()):
        return ""
    f = strong_minilm_facts(_load(CONTROLS_STRONG_MINILM), _load(CONTROLS_MINILM))
    return "; and with that teacher and the pretrained text tower, " + ", ".join(
        f"{name} − plain-minilm-tuned is {_signed(a['paired']['gap'])} {_gap_text(a['paired'], 'paired by seed')}"
        + (f", reaching its final at {_ratio_cell(a['crossings'][0])} of its samples" if a["crossings"] else "")
        for name, a in f["arms"].items())


def readme_controls(res: dict, root: str = "", docs: str = "docs/") -> str:
    """The README's one line on the controls (replacing the efficiency figure's 'not controlled yet');
    ``root`` / ``docs``: the paths from the page to the checkout's root and to docs/."""
    f = controls_facts(res)
    fin, c = f["fin"], f["comparisons"][("reinforced", "plain-minilm")]
    rein, minilm = f["arms"]["reinforced"], f["arms"]["plain-minilm"]
    collapsed = _at_chance(minilm)
    return (f"Controls ([recipe]({root}configs/experiments/cpu-demo-controls.yaml), [details]({docs}experiments.md"
            f"#controls-of-the-cpu-efficiency-figure-issue-37-part-3); fresh seeds {res['seeds'][0]}–"
            f"{res['seeds'][-1]}): plain with the teacher's pretrained MiniLM text tower ends at "
            f"{fin['plain-minilm']['mean_recall']:.3f} ({len(minilm['seeds'])} seeds, {len(collapsed)} at chance; "
            f"lr not re-tuned), plain {fin['plain']['mean_recall']:.3f} ({len(f['arms']['plain']['seeds'])} "
            f"seeds), reinforced {fin['reinforced']['mean_recall']:.3f}: reinforced − plain-minilm "
            f"{_signed(c['gap'])} {_bounds(c['gap_ci'])} ({_gap_reading(c)}){_readme_tuned(f)}{_readme_minilm(res)}; "
            f"reinforced reaches plain's final "
            f"at {_ratio_cell(rein['crossings'][0])} of plain's samples, 95 % of it at "
            f"{_ratio_cell(rein['crossings'][1])}; the teacher's compute is "
            f"{f['cost']['teacher_compute_s']:.0f} s, {f['cost']['teacher_compute_s'] / f['plain_run_s']:.1f} "
            f"plain runs{_readme_strong(res)}{_readme_strong_minilm()}.")


# --------------------------------------------------------------------------- phantom ladder


LADDER_MAPS = [("pointing_z", "z"), ("pointing_z_pathology", "z, pathology boxes"), ("pointing_attn", "attention")]


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
    pooled = res.get("margins_over_train_prior")
    lines += ["", "± is over seeds only. Chance and the train-box prior are one fixed number per report set (no "
                  "seed varies them); " + (
                      "the uncertainty over the evaluation images is in the paired margins below (a bootstrap "
                      f"over the report set's {_n_images(pooled)} images)." if pooled else
                      "the results file holds no image-level uncertainty for them or for the pointing games (no "
                      "per-image hits, no target counts)."), ""]
    lines += [f"- {b['bar']}: {_num(b.get('value'))} (limit {_num(b.get('limit'))}) — {_verdict(b.get('met'))}"
              for b in res.get("bars") or []]
    return lines


def ladder_margins_rows(res: dict) -> list[dict]:
    out = []
    for row in res["table"]:
        for key, label in LADDER_MAPS:
            model, prior = row.get(f"{key}_seeds"), row.get(f"train_prior_{key}_seeds")
            if not model or not prior:
                continue
            diffs = [m - p for m, p in zip(model, prior)]
            mean, lo, hi = _interval(diffs)
            pooled = _pooled(res, row["run"], key)
            out.append({"run": row["run"], "map": label, "model": model, "prior": prior, "diffs": diffs,
                        "mean": mean, "lo": lo, "hi": hi, "pooled": pooled})
    return out


def _n_images(pooled: dict) -> int:
    return max(m["n_images"] for figures in pooled.values() for m in figures.values())


def _bounds(interval) -> str:
    return f"[{_signed(interval[0])}, {_signed(interval[1])}]"


def _above(r: dict) -> bool | None:
    """True: every interval of the margin (seeds; images and seeds) excludes 0 from above; False: one
    excludes it from below; None: one includes 0."""
    ends = [(r["lo"], r["hi"])] + ([tuple(r["pooled"]["interval"])] if r["pooled"] else [])
    if all(lo > 0 for lo, _ in ends):
        return True
    return False if any(hi < 0 for _, hi in ends) else None


def _against_prior(r: dict) -> str:
    return {True: "above the train-box prior (intervals exclude 0)",
            False: "below the train-box prior (an interval excludes 0)"}.get(
        _above(r), "**not shown** above the train-box prior (an interval includes 0)")


def ladder_margins(res: dict) -> list[str]:
    pooled = bool(res.get("margins_over_train_prior"))
    lines = [f"Against the strongest image-blind baseline, per seed (seeds {res['seeds']}): PG − train-box "
             "prior, paired on each seed's own evaluation, mean with its 95 % t-interval over seeds" + (
                 "; and the same margin paired per target and pooled over the seeds, with 95 % percentile-"
                 "bootstrap intervals over the report set's images (seeds fixed) and over images and seeds "
                 "together (`margins_over_train_prior`):" if pooled else ":"), "",
             "| variant | map | PG | train prior | PG − prior per seed | mean [95 % over seeds] |"
             + (" over images | over images and seeds |" if pooled else "") + " reading |",
             "|---|---|---|---|---|---|" + ("---|---|" if pooled else "") + "---|"]
    for r in ladder_margins_rows(res):
        boot = (f" {_bounds(r['pooled']['interval_images'])} | {_bounds(r['pooled']['interval'])} |"
                if pooled else "")
        lines.append(f"| {r['run']} | {r['map']} | {_ci(r['model'])} | {_ci(r['prior'])} | "
                     f"{', '.join(_signed(d) for d in r['diffs'])} | {_signed(r['mean'])} "
                     f"[{_signed(r['lo'])}, {_signed(r['hi'])}] |{boot} {_against_prior(r)} |")
    return lines


def _margin(r: dict, with_run: bool = True) -> str:
    boot = f" / {_bounds(r['pooled']['interval'])}" if r["pooled"] else ""
    return f"{r['run'] + ' ' if with_run else ''}{_signed(r['mean'])} [{_signed(r['lo'])}, {_signed(r['hi'])}]{boot}"


def ladder_reading(res: dict, docs: str = "") -> list[str]:
    rows = {(r["run"], r["map"]): r for r in ladder_margins_rows(res)}
    table = {row["run"]: row for row in res["table"]}
    runs = list(table)
    met = all(b.get("met") for b in res["bars"])

    def span(key):
        vals = sorted(table[r][key] for r in runs)
        lo, hi = f"{vals[0]:.2f}", f"{vals[-1]:.2f}"
        return lo if lo == hi else f"{lo}–{hi}"

    z = [rows[(r, "z")] for r in runs]
    att = [rows[(r, "attention")] for r in runs]
    worst = min((d, r["run"]) for r in att for d in r["diffs"])
    z_note = " — above the prior" if all(_above(r) for r in z) else " — not shown above the prior for every variant"
    att_note = (" — above the prior" if all(_above(r) for r in att)
                else " — not shown above the prior for every variant: an interval includes 0")
    limits = {kind: _num(next(b["limit"] for b in res["bars"] if f"pointing_{kind} " in b["bar"]))
              for kind in ("z", "attn")}
    first = runs[0]
    z_seeds = ", ".join(f"{v:.2f}" for v in table[first]["pointing_z_seeds"])
    def against(kind):
        bars = [b for b in res["bars"] if f"pointing_{kind} " in b["bar"]]
        if all(b.get("met") for b in bars):
            return f"at or above its limit {limits[kind]}"
        short = ", ".join(f"{b['bar'].split()[0]} by {b['limit'] - b['value']:.3f}" for b in bars if not b.get("met"))
        return f"short of its limit {limits[kind]} ({short})"

    return [
        f"**Ladder: {'MET' if met else 'MISSED'}** — {' and '.join(runs)} point at {span('pointing_z')} (z: "
        f"{against('z')}) and {span('pointing_attn')} (attention: {against('attn')}) on average; each limit is "
        f"the higher of 0.80 / 0.70 and the train prior + 0.15. Against the "
        f"train-box prior, paired per seed [95 % over seeds]" + (" / [over images and seeds]" if z[0]["pooled"] else "")
        + f": z {', '.join(_margin(r) for r in z)}{z_note}; attention "
        f"{', '.join(_margin(r) for r in att)}{att_note} (worst seed: {worst[1]} {_signed(worst[0])}). "
        f"{first}'s z per seed: {z_seeds}. {ladder_shift(res, docs)}"]


def limitations_ladder(res: dict) -> list[str]:
    """docs/limitations.md's ladder sentence: the bars, the margins over the train-box prior, the code shift."""
    rows = {(r["run"], r["map"]): r for r in ladder_margins_rows(res)}
    runs = [row["run"] for row in res["table"]]
    bars = "; ".join(f"{b['bar'].split(' >=')[0]} {_num(b.get('value'))} (limit {_num(b.get('limit'))}) "
                     f"{_verdict(b.get('met'))}" for b in res["bars"])
    margins = "; ".join(f"{kind} " + ", ".join(_margin(rows[(run, kind)]) for run in runs)
                        for kind in ("z", "attention"))
    return [f"  bars: {bars}. PG − train-box prior, paired per seed [95 % over seeds] / [over images and seeds]: "
            f"{margins}. {ladder_shift(res)}"]


def ladder_shift(res: dict, docs: str = "") -> str:
    """The previous measurement of the same recipe and seeds on older code, and how far the code moved it
    (``docs``: the path from the page to docs/, "docs/" from the README)."""
    before = {row["run"]: row for row in _load(LADDER_BEFORE)["table"]}
    now = {row["run"]: row for row in res["table"]}
    moves = "; ".join(f"{run} z {before[run]['pointing_z']:.3f} → {now[run]['pointing_z']:.3f}, attention "
                      f"{before[run]['pointing_attn']:.3f} → {now[run]['pointing_attn']:.3f}"
                      for run in now if run in before)
    return (f"The same recipe and seeds measured on the code of {LADDER_BEFORE_COMMIT} ({LADDER_BEFORE_DATE}, "
            f"[kept]({docs}results/superseded/cpu-ladder-{LADDER_BEFORE_COMMIT}.json)) gave: {moves}; the "
            f"training code changed between (not bisected): these shifts are a code version's, as large as the "
            f"margins to the bars.")


def readme_ladder(res: dict) -> list[str]:
    table = {row["run"]: row for row in res["table"]}
    first = next(iter(table.values()))
    rows = {(r["run"], r["map"]): r for r in ladder_margins_rows(res)}
    boot_head = "] / [over images and seeds" if res.get("margins_over_train_prior") else ""
    lines = [f"**A–E ladder** (`train experiment ablation --config configs/experiments/cpu-ladder.yaml`; seeds "
             f"{res['seeds'][0]}–{res['seeds'][-1]}; chance z {first['chance_pointing_z']:.3f}, attention "
             f"{first['chance_pointing_attn']:.3f}; train-box prior z {first['train_prior_pointing_z']:.3f}, "
             f"attention {first['train_prior_pointing_attn']:.3f}: one fixed map each, no seed varies them):", "",
             f"| variant | mean R (chance {first['chance_mean_recall']:.3f}) | PG z | z − train prior, paired per seed "
             f"[95 % over seeds{boot_head}] | PG attn | attn − train prior, paired per seed [95 % over seeds"
             f"{boot_head}] |", "|---|---|---|---|---|---|"]
    for run, row in table.items():
        z, a = rows[(run, "z")], rows[(run, "attention")]
        lines.append(f"| {run} | {_ci(row['mean_recall_seeds'])} | {_ci(row['pointing_z_seeds'])} | "
                     f"{_margin(z, with_run=False)} | {_ci(row['pointing_attn_seeds'])} | "
                     f"{_margin(a, with_run=False)} |")
    bars = "; ".join(f"{b['bar'].split(' >=')[0]} {_num(b.get('value'))} (limit {_num(b.get('limit'))}) "
                     f"{_verdict(b.get('met'))}" for b in res["bars"])
    return lines + ["", f"Bars (PG z ≥ 0.8, PG attn ≥ 0.7, each ≥ train prior + 0.15): {bars}."] + ladder_reading(res, "docs/")


# --------------------------------------------------------------------------- NIH


@functools.lru_cache(maxsize=None)
def _nih_md() -> dict:
    """docs/results/nih-tables.md -> {"summary": {arm: {column: text}}, "findings": {arm: {finding: {column: text}}}}."""
    text = NIH_TABLES.read_text()
    out = {"summary": {}, "findings": {}}
    blocks = re.split(r"\n(?=\*\*|### )", text)
    for block in blocks:
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if len(rows) < 3:
            continue
        head = [c.strip() for c in rows[0].strip("|").split("|")]
        table = {}
        for ln in rows[2:]:
            cells = [c.strip() for c in ln.strip("|").split("|")]
            table[cells[0]] = dict(zip(head, cells))
        if block.startswith("### Summary"):
            out["summary"] = table
        elif block.startswith("### "):  # the margins table: headline.py reads those from the results JSON
            continue
        else:
            arm = re.match(r"\*\*(.+?)\*\*", block).group(1)
            out["findings"][arm] = table
    return out


def _val(cell: str) -> float:
    return float(cell.split("±")[0])


NIH_ARMS = {"plain": "plain (NIH train only)", "reinforced": "reinforced (NIH teacher, stored)",
            "transfer": "transfer (phantom only, no real training)",
            "fine-tuned": "phantom -> fine-tuned on NIH train"}


@functools.lru_cache(maxsize=None)
def nih_facts() -> dict:
    res, md = _load(NIH), _nih_md()
    rows = {r["run"]: r for r in res["table"]}
    p, r = rows["plain"], rows["reinforced"]
    auc = {name: {f: _val(c["zero-shot AUC"]) for f, c in md["findings"][NIH_ARMS[name]].items()}
           for name in ("plain", "reinforced", "fine-tuned")}
    diffs = {f: auc["reinforced"][f] - auc["plain"][f] for f in auc["plain"]}
    margins = {}
    for arm, row in rows.items():
        for kind in ("z", "attention"):
            key = f"pg_{kind}"
            if f"{key}_seeds" in row:
                d = [m - q for m, q in zip(row[f"{key}_seeds"], row[f"{key}_train_prior_seeds"])]
                margins[(arm, kind)] = _interval(d) + ((_pooled(res, arm, key) or {}).get("interval"),)
    teacher = next(iter(res["teachers"].values()))
    return {"res": res, "md": md, "rows": rows, "p": p, "r": r, "auc": auc, "diffs": diffs, "margins": margins,
            "teacher": teacher, "samples": _bar(res, "reinforced reaches"), "quality": _bar(res, "reinforced final"),
            "online": _bar(res, "online step"), "stored": _bar(res, "stored step")}


def nih_bars_rows() -> list[tuple[str, str, bool, str]]:
    """(bar, measured, met, margin) for issue 24's bars, the localisation bars against the LOO prior (as first
    judged) and against the train-box prior (the strongest image-blind baseline)."""
    f = nih_facts()
    r, res = f["r"], f["res"]
    out = [(f"reinforced mean zero-shot AUC ≥ {NIH_AUC_BAR:.2f} (8 findings, ≥ 5 seeds)",
            _ci(r["zero_shot_auc_mean_seeds"]), r["zero_shot_auc_mean"] >= NIH_AUC_BAR,
            f"by {NIH_AUC_BAR - r['zero_shot_auc_mean']:.3f}")]
    for kind, label in (("attention", "attention"), ("z", "z")):
        pg, chance = r[f"pg_{kind}"], r[f"pg_{kind}_chance"]
        for prior_key, prior_name in (("prior", "LOO prior"), ("train_prior", "train-box prior")):
            prior = r[f"pg_{kind}_{prior_key}"]
            limit = max(2 * chance, prior + NIH_PG_MARGIN)
            out.append((f"{label} PG ≥ 2× chance and ≥ {prior_name} + {NIH_PG_MARGIN:.2f}",
                        f"{pg:.3f} vs 2 × {chance:.3f} = {2 * chance:.3f} and {prior:.3f} + {NIH_PG_MARGIN:.2f} = "
                        f"{prior + NIH_PG_MARGIN:.3f}", pg >= limit, f"by {limit - pg:.3f}"))
    q = f["quality"]
    out.append(("reinforced − plain > 2 sd of plain's seeds, zero-shot AUC (the recipe's declared final metric)",
                f"{_signed(q['value'])} vs 2 sd = {q['limit']:.3f}", q["met"], ""))
    s = f["samples"]
    hi = "inf" if s["ci"][1] is None else f"{s['ci'][1]:.2f}"
    upper = _samples_upper_limit(s)
    miss = (f"by {s['value'] - s['limit']:.2f}" if s["value"] > s["limit"] else
            f"upper 95 % {hi} > {upper:g}")
    out.append((f"reinforced reaches plain's final with ≤ ½ of plain's samples, upper 95 % ≤ {upper:g}",
                f"{s['value']:.2f} [{s['ci'][0]:.2f}, {hi}]", s["met"], miss))
    return out


def _samples_upper_limit(bar: dict) -> float:
    """The samples bar's limit on the ratio's upper 95 % bound, as its text states it."""
    return float(re.search(r"upper bound <= ([0-9.]+)", bar["bar"]).group(1))


def nih_bars() -> list[str]:
    lines = ["| bar | measured | verdict |", "|---|---|---|"]
    for bar, measured, met, margin in nih_bars_rows():
        lines.append(f"| {bar} | {measured} | {_verdict(met)}" + (f" {margin}" if margin and not met else "") + " |")
    f = nih_facts()
    p, r = f["p"], f["r"]
    lines += ["", "Beside them, not bars: probe AUC, reinforced − plain "
                  f"{_signed(r['probe_auc'] - p['probe_auc'])} (plain's 2 sd {2 * p['probe_auc_sd']:.3f}) — not the "
                  "declared metric, not claimed; the pointing games' paired per-seed margin over the train-box prior "
                  "(mean [95 % over seeds" + ("; over test images and seeds, bootstrap" if any(
                      m[3] for m in f["margins"].values()) else "") + "]): " + "; ".join(
                      f"{arm} {kind} {_signed(m[0])} [{_signed(m[1])}, {_signed(m[2])}"
                      + (f"; {_signed(m[3][0])}, {_signed(m[3][1])}" if m[3] else "") + "]"
                      for (arm, kind), m in f["margins"].items()) + "."]
    return lines


def _nih_arm_cells(name: str, f: dict) -> dict:
    """One arm's summary cells of nih-tables.md; a constant over seeds (chance, priors) prints without ± 0.000."""
    md = {k: v.replace(" ± 0.000", "") for k, v in f["md"]["summary"][NIH_ARMS[name]].items()}
    return {"seeds": md["seeds"], "auc": md["zero-shot AUC (blind 0.5)"], "pg_z": md["PG z"],
            "z_chance": md["z chance"], "z_loo": md["z LOO prior"], "z_train": md["z train prior"],
            "pg_attn": md["PG attn"], "attn_chance": md["attn chance"], "attn_loo": md["attn LOO prior"],
            "attn_train": md["attn train prior"], "iobb_attn": md["T(IoBB)>0.1 attn"]}


def _nih_check_md_against_json(f: dict) -> None:
    """The md's plain/reinforced summary rows are the JSON's (scripts/nih-tables.py and the experiment read the
    same runs); a mismatch means one of the two files is stale."""
    for name in ("plain", "reinforced"):
        row, md = f["rows"][name], f["md"]["summary"][NIH_ARMS[name]]
        for col, key in (("zero-shot AUC (blind 0.5)", "zero_shot_auc_mean"), ("PG z", "pg_z"),
                         ("PG attn", "pg_attention")):
            if md[col] != _ci(row[f"{key}_seeds"]):
                raise ValueError(f"nih-tables.md {name} {col} {md[col]} != nih-efficiency.json {_ci(row[f'{key}_seeds'])}")


def nih_table() -> list[str]:
    f = nih_facts()
    _nih_check_md_against_json(f)
    lines = ["| arm | seeds | zero-shot AUC (blind 0.5) | PG z (chance / LOO / **train prior**) | PG attention "
             "(chance / LOO / **train prior**) | T(IoBB)>0.1 attn | probe AUC | mean R (chance "
             f"{f['p']['chance_mean_recall']:.3f}) |", "|---|---|---|---|---|---|---|---|"]
    labels = {"plain": "plain (NIH train only)", "reinforced": "reinforced (NIH teacher, stored)",
              "transfer": "transfer (phantom only)", "fine-tuned": "phantom → fine-tuned on NIH train"}
    prior_iobb = f["md"]["findings"][NIH_ARMS["plain"]]
    for name, label in labels.items():
        c = _nih_arm_cells(name, f)
        row = f["rows"].get(name)
        extra = (f"{_ci(row['probe_auc_seeds'])} | {_ci(row['mean_recall_seeds'])}" if row else " | ")
        lines.append(f"| {label} | {c['seeds']} | {c['auc']} | {c['pg_z']} ({c['z_chance']} / {c['z_loo']} / "
                     f"**{c['z_train']}**) | {c['pg_attn']} ({c['attn_chance']} / {c['attn_loo']} / "
                     f"**{c['attn_train']}**) | {c['iobb_attn']} | {extra} |")
    t = f["teacher"]["student_test"]
    lines.append(f"| the teacher itself (`lite2-nih`, global only) | 1 | – (the benchmark was not run on it) | – | – "
                 f"| – | {t['probe_auc']:.3f} | {t['mean_recall']:.3f} |")
    p, r = f["p"], f["r"]
    lines += ["", f"The teacher's only zero-shot figure in the results file is the shard evaluation's own "
                  f"(`zeroshot_auc`: its label list and prompts, not the benchmark's 8 findings), on the same test "
                  f"images: teacher {t['zeroshot_auc']:.3f}, plain {_ci(p['zeroshot_auc_seeds'])}, reinforced "
                  f"{_ci(r['zeroshot_auc_seeds'])}. Retrieval (mean R) is between label-composed texts, which "
                  f"the recipe itself calls meaningless: shown, not claimed."]
    return lines


def nih_findings() -> list[str]:
    f = nih_facts()
    findings = list(f["auc"]["plain"])
    n_pos = {k: v["n pos / boxes"].split("/")[0].strip() for k, v in f["md"]["findings"][NIH_ARMS["plain"]].items()}
    lines = ["| arm | " + " | ".join(f"{k} ({n_pos[k]})" for k in findings) + " |", "|---|" + "---|" * len(findings)]
    for name in ("plain", "reinforced", "fine-tuned"):
        cells = f["md"]["findings"][NIH_ARMS[name]]
        lines.append(f"| {name} | " + " | ".join(cells[k]["zero-shot AUC"] for k in findings) + " |")
    lines.append("| reinforced − plain (means) | " + " | ".join(_signed(f["diffs"][k]) for k in findings) + " |")
    worse = sorted((d, k) for k, d in f["diffs"].items() if d < 0)
    better = [k for k, d in f["diffs"].items() if d > 0]
    lines += ["", f"Reinforced is above plain's mean on {len(better)} of {len(findings)} findings and below it on "
                  f"{len(worse)} ({', '.join(f'{k} {_signed(d, 2)}' for d, k in worse)}); the file holds each arm's "
                  f"mean and 95 % interval per finding, not paired per-seed differences, and most intervals "
                  f"overlap. Over all 8 findings the gain is {_signed(f['quality']['value'])}, inside 2 sd of "
                  f"plain's seeds ({f['quality']['limit']:.3f})."]
    return lines


def nih_efficiency() -> list[str]:
    f = nih_facts()
    res, s = f["res"], f["samples"]
    cross, cost, bench = res["arms"]["reinforced"]["crossing"], res["cost"], res["bench_step_ms"]
    steps = res["recipe"]["efficiency"]["step_benchmark"]["steps"]
    hi = "inf" if s["ci"][1] is None else f"{s['ci'][1]:.2f}"
    plain_xs = res["arms"]["plain"]["curve_mean"]["xs"]
    last = (", its last evaluation" if cross["plain_samples"] == plain_xs[-1] else
            f", before its last evaluation ({plain_xs[-1]:,.0f})")
    return [f"Efficiency on real images (curve: val zero-shot AUC; the same first-crossing rule for both arms, as on "
            f"the phantom): plain's curve first reaches its final ({cross['target']:.3f}) at "
            f"{cross['plain_samples']:,.0f} samples{last}; reinforced at **{cross['samples']:,.0f} = "
            f"{cross['ratio']:.2f} of plain's samples [95 % bootstrap {s['ci'][0]:.2f}, {hi}]** "
            f"({_verdict(s['met'])}: the bar asks ≤ ½ with the upper 95 % ≤ {_samples_upper_limit(s):g}). Step time (interleaved, median of {steps} steps per arm, CPU): plain "
            f"{bench['plain']:.0f} ms, stored {bench['reinforced']:.0f} ms ({f['stored']['value']:.2f}×, "
            f"{_verdict(f['stored']['met'])} ≤ 1.05×), online teacher {bench['online']:,.0f} ms "
            f"({f['online']['value']:.2f}× stored: the bar's 3× is {_verdict(f['online']['met'])}, the teacher is "
            f"small); break-even of the one-off teacher embedding ({cost['total_s']:.0f} s): "
            f"{cost['break_even_runs']:.2f} training runs, not counting the teacher's "
            f"{f['teacher']['train_wall_s']:.0f} s of training. The teacher's {cost['teacher_train_samples']:,} "
            f"training samples are passes over the students' own train images (no extra data); counted in, "
            f"reinforced needs {cost['reinforced_ratio_with_teacher']:.2f}× plain's samples."]


def _shift(before: list[float], after: list[float]) -> tuple[str, str]:
    """(direction, figures) of ``after`` against ``before`` (two arms' seeds): 'lower' / 'higher' where the
    Welch interval of the difference excludes 0, else 'no different beyond seed noise'; figures
    'a → b; diff [lo, hi], Welch'."""
    g = gap_interval(after, before)
    lo, hi = g["gap_ci"]
    return _direction(lo, hi), f"{_ci(before)} → {_ci(after)}; {_signed(g['gap'])} {_bounds(g['gap_ci'])}, Welch"


def _than_plain(direction: str) -> str:
    return {"lower": "lower than plain's", "higher": "higher than plain's"}.get(
        direction, "no different from plain's beyond seed noise")


def _direction(lo: float, hi: float) -> str:
    return "lower" if hi < 0 else "higher" if lo > 0 else "no different beyond seed noise"


def _shift_cells(before: str, n_before: int, after: str, n_after: int) -> tuple[str, str]:
    """``_shift`` from two 'mean ± 95 % half-width' cells of nih-tables.md (the md holds no per-seed values):
    each sd recovered from its half-width, then the same Welch interval (stats.welch_half_width)."""
    def mean_sd(cell, n):
        mean, half = (float(x) for x in cell.split("±"))
        return mean, half * math.sqrt(n) / student_t.ppf(0.975, n - 1)

    (ma, sa), (mb, sb) = mean_sd(before, n_before), mean_sd(after, n_after)
    gap, half = mb - ma, welch_half_width(sb, n_after, sa, n_before)
    return _direction(gap - half, gap + half), f"{before} → {after}; {_signed(gap)} [{_signed(gap - half)}, {_signed(gap + half)}], Welch"


def _nih_below_prior(f: dict) -> bool:
    """Every arm's mean pointing game (z and attention) below its train-box prior."""
    rows = f["md"]["summary"]
    return all(_val(row[f"PG {k}"]) < _val(row[f"{k} train prior"]) for row in rows.values() for k in ("z", "attn"))


def nih_reading() -> list[str]:
    f = nih_facts()
    p, r, md = f["p"], f["r"], f["md"]
    prior = md["findings"][NIH_ARMS["plain"]]
    fine, tr = _nih_arm_cells("fine-tuned", f), _nih_arm_cells("transfer", f)
    worse = sorted((d, k) for k, d in f["diffs"].items() if d < 0)
    att_verb, att = _shift(p["pg_attention_seeds"], r["pg_attention_seeds"])
    z_verb, z = _shift(p["pg_z_seeds"], r["pg_z_seeds"])
    n_fine = int(md["summary"][NIH_ARMS["fine-tuned"]]["seeds"])
    auc_verb, auc = _shift_cells(_ci(p["zero_shot_auc_mean_seeds"]), len(p["zero_shot_auc_mean_seeds"]),
                                 fine["auc"], n_fine)
    below = _nih_below_prior(f)
    transfer_auc = float(tr["auc"].split("±")[0])
    return [
        f"- **{'No student localises on real radiographs' if below else 'Localisation on real radiographs'}.** "
        f"{'Every' if below else 'Not every'} arm's mean pointing game is below the train-box prior: one "
        f"fixed map of where the train split's boxes lie points at {p['pg_z_train_prior']:.2f} (z) and "
        f"{p['pg_attention_train_prior']:.2f} (attention), and at "
        f"{_val(prior['Cardiomegaly']['(chance / LOO / train prior)'].split('/')[2]):.2f} for "
        f"cardiomegaly's attention. Against plain, reinforced's mean pointing game is {att_verb} for the "
        f"attention ({att}) and {z_verb} for z ({z}).",
        f"- **Zero-shot AUC {'barely leaves chance' if max(p['zero_shot_auc_mean'], r['zero_shot_auc_mean']) < 0.6 else 'leaves chance'}** "
        f"(plain {p['zero_shot_auc_mean']:.3f}, reinforced {r['zero_shot_auc_mean']:.3f}; chance 0.5), and "
        f"reinforcement {'does not show' if not f['quality']['met'] else 'shows'} a gain on the declared metric: "
        f"{_signed(f['quality']['value'])}, {'inside' if not f['quality']['met'] else 'beyond'} 2 sd of plain "
        f"({f['quality']['limit']:.3f}); per finding it is below plain's mean on "
        f"{', '.join(f'{k} ({_signed(d, 2)})' for d, k in worse) or 'none'}. Retrieval: "
        f"{_ci(p['mean_recall_seeds'])} → {_ci(r['mean_recall_seeds'])} (chance {p['chance_mean_recall']:.3f}), "
        f"between label-composed texts, which mean little; probe AUC {_signed(r['probe_auc'] - p['probe_auc'])}, "
        f"not the declared metric: neither is claimed.",
        f"- **The phantom does {'not ' if auc_verb != 'higher' else ''}help.** Transfer alone gives "
        f"{tr['auc']} (one seed; chance 0.5{', near it' if abs(transfer_auc - 0.5) < 0.05 else ''}), and "
        f"starting NIH training from the phantom student gives a zero-shot AUC "
        f"{ {'lower': 'lower than', 'higher': 'higher than'}.get(auc_verb, 'no different, beyond seed noise, from')} "
        f"starting from ImageNet ({auc})."]


def nih_shift() -> list[str]:
    """The NIH recipe's first results file beside today's: how far the code version moved each arm."""
    before = {row["run"]: row for row in _load(NIH_BEFORE)["table"]}
    now = {row["run"]: row for row in _load(NIH)["table"]}
    codes = sorted({r["train_summary"]["code"]["commit"][:7] for runs in _load(NIH)["runs"].values() for r in runs
                    if (r.get("train_summary") or {}).get("code")})
    cells = "; ".join(f"{arm}: zero-shot AUC {before[arm]['zero_shot_auc_mean']:.3f} → "
                      f"{now[arm]['zero_shot_auc_mean']:.3f}, PG z {before[arm]['pg_z']:.3f} → {now[arm]['pg_z']:.3f}, "
                      f"PG attention {before[arm]['pg_attention']:.3f} → {now[arm]['pg_attention']:.3f}"
                      for arm in now if arm in before and "zero_shot_auc_mean" in now[arm])
    return [f"The figures on this page were re-measured on 2026-11-26 from an empty folder (runs on the code of "
            f"{', '.join(codes)}). The first results file ({NIH_BEFORE_COMMIT}, "
            f"[kept](results/superseded/nih-efficiency-{NIH_BEFORE_COMMIT}.json); its runs recorded no code) "
            f"against them, seed means: {cells}. The code changed between (above); the reading of the page "
            f"follows the new figures."]


def nih_iobb() -> list[str]:
    f = nih_facts()
    prior = f["md"]["findings"][NIH_ARMS["plain"]]
    reinf = f["md"]["findings"][NIH_ARMS["reinforced"]]
    n = f["md"]["summary"][NIH_ARMS["reinforced"]]["seeds"]
    findings = list(prior)
    return ["| T(IoBB) > 0.1 | " + " | ".join(findings) + " |", "|---|" + "---|" * len(findings),
            "| Wang et al. 2017 (ResNet-50, ~10⁵ images; their paper) | " + " | ".join(
                f"{WANG_2017[k]:.2f}" for k in findings) + " |",
            f"| train-box prior (image-blind, ours) | " + " | ".join(
                f"{_val(prior[k]['train prior >0.1']):.2f}" for k in findings) + " |",
            f"| cxrdr reinforced `cpu-D`, attention (562 images, {n} seeds) | " + " | ".join(
                f"{_val(reinf[k]['T(IoBB)>0.1 attn']):.2f}" for k in findings) + " |"]


def readme_nih() -> list[str]:
    f = nih_facts()
    _nih_check_md_against_json(f)
    p = f["p"]
    lines = [f"| arm | zero-shot AUC (blind 0.5) | PG z (chance {p['pg_z_chance']:.3f}, train prior "
             f"{p['pg_z_train_prior']:.3f}) | PG attention (chance {p['pg_attention_chance']:.3f}, train prior "
             f"{p['pg_attention_train_prior']:.3f}) |", "|---|---|---|---|"]
    for name, label in (("plain", "plain"), ("reinforced", "reinforced (NIH-trained teacher, stored)"),
                        ("fine-tuned", "phantom-trained, fine-tuned on NIH")):
        c = _nih_arm_cells(name, f)
        lines.append(f"| {label} | {c['auc']} | {c['pg_z']} | {c['pg_attn']} |")
    bars = nih_bars_rows()
    missed = [b for b in bars if not b[2]]
    auc, att_tp, z_tp = bars[0], bars[2], bars[4]
    worse = sorted((d, k) for k, d in f["diffs"].items() if d < 0)
    lines += ["", f"{'Every quality bar is **MISSED**' if len(missed) == len(bars) else 'Bars: see the page'}: "
                  f"zero-shot AUC ≥ {NIH_AUC_BAR:.2f} {auc[3]}; pointing ≥ train-box prior + {NIH_PG_MARGIN:.2f} — "
                  f"attention {att_tp[3]}, z {z_tp[3]}; reinforced − plain ({_signed(f['quality']['value'])}) inside "
                  f"2 sd of plain ({f['quality']['limit']:.3f}); samples to plain's final {bars[-1][1]} "
                  f"(bar ≤ ½, upper 95 % ≤ {_samples_upper_limit(f['samples']):g}). Reinforced's mean attention pointing game is "
                  f"{_than_plain(_shift(p['pg_attention_seeds'], f['r']['pg_attention_seeds'])[0])} "
                  f"({p['pg_attention']:.3f} → {f['r']['pg_attention']:.3f}); its mean zero-shot AUC is below plain's on "
                  f"{', '.join(f'{k} ({_signed(d, 2)})' for d, k in worse) or 'no finding'}. The teacher is small and saw only "
                  f"the students' own train images{'' if f['teacher']['train_images_shared'] == 1.0 else ' (in part)'}, "
                  f"and label-composed text never says *where* a finding is."]
    return lines


# --------------------------------------------------------------------------- image-only (issue 39)


def _seed_span(seeds: list[int]) -> str:
    return f"{seeds[0]}–{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ", ".join(map(str, seeds))


def readme_image_only(res: dict) -> list[str]:
    """The README paragraph of configs/experiments/image-only.yaml, from docs/results/image-only.json."""
    io = res["image_only"]
    roles, fig, arms = io["roles"], io["figures"], list(io["figures"])
    seeds = {a: [s["seed"] for s in res["runs"][a]] for a in arms}
    common = max(seeds.values(), key=len)
    others = {a: s for a, s in seeds.items() if s != common}

    def mean(arm, key):
        return fig[arm][key]["mean"]

    arm, base, ceil = roles["arm"], roles["baseline"], roles["ceiling"]
    gap_bar, ratio_bar = io["bars"]
    labels = next((a for a in arms if a not in (arm, base, ceil)), None)
    prior_z, prior_a = mean(arm, "train_prior_pointing_z"), mean(arm, "train_prior_pointing_attn")
    below = [a for a in arms if mean(a, "pointing_attn") < prior_a]
    ground = io["grounding"][arm]
    line = (f"`configs/experiments/image-only.yaml` ([details](docs/experiments.md#what-retrieved-captions-buy-issue-39-"
            f"reports-hidden-images-kept), [results](docs/results/image-only.json)) hides the reports of 80 % of the "
            f"phantom's train studies; on its report phantom, fresh seeds {_seed_span(common)}"
            + "".join(f" ({a.split('-')[-1]} {_seed_span(s)})" for a, s in others.items())
            + f", mean R ± sd (chance {mean(arm, 'chance_mean_recall'):.3f}): "
            + ", ".join(f"{a} {mean(a, 'mean_recall'):.3f} ± {fig[a]['mean_recall']['sd']:.3f}" for a in arms)
            + "; probe AUC " + " / ".join(f"{mean(a, 'probe_auc'):.3f}" for a in arms) + ". "
            f"Bars: {arm} − {base} {_signed(gap_bar['value'])} against > 2 sd of {base} = {gap_bar['limit']:.3f} "
            f"{_verdict(gap_bar['met'])}; {arm} / {ceil} {ratio_bar['value']:.2f} against ≥ {ratio_bar['limit']} "
            f"{_verdict(ratio_bar['met'])}")
    if ratio_bar["value"] > 1:
        line += (f" — the teacher's distillation carries much of it ({arm} beats the ceiling, which has no "
                 f"teacher)")
    if labels:
        line += (f"; with the same teacher, retrieved captions {'beat' if mean(arm, 'mean_recall') > mean(labels, 'mean_recall') else 'do not beat'} "
                 f"label templates ({labels}) by {_signed(mean(arm, 'mean_recall') - mean(labels, 'mean_recall'), 2)} mean R")
    line += (f". Pointing (train-box prior z {prior_z:.3f}, attention {prior_a:.3f}): z "
             + " / ".join(f"{mean(a, 'pointing_z'):.2f}" for a in arms) + ", attention "
             + " / ".join(f"{mean(a, 'pointing_attn'):.2f}" for a in arms)
             + (f" — below the prior in attention: {', '.join(below)}" if below else " — every arm's attention above the prior")
             + f". Retrieved sentences assert a finding the image has {_pct(ground['val']['hit_rate'])} of the time on "
             f"val ({_pct(ground['train']['hit_rate'])} train) vs the bank's base rate of "
             f"{_pct(ground['val']['bank_base_rate'])}.")
    return [line]


def _nih_retrieved_arms(res: dict) -> tuple[dict, dict, list[int]]:
    """(labels row, retrieved row, seeds) of nih-retrieved's table; both arms trained the same seeds, so
    their per-seed values pair up."""
    rows = {r["run"]: r for r in res["table"] if "n_seeds" in r}
    seeds = [s["seed"] for s in res["runs"]["reinforced-retrieved"]]
    assert seeds == [s["seed"] for s in res["runs"]["reinforced-labels"]], "paired differences need the same seeds"
    return rows["reinforced-labels"], rows["reinforced-retrieved"], seeds


def _paired(labels: dict, retrieved: dict, key: str) -> str:
    """retrieved − labels, per seed: 'mean ± 95 % t half-width'."""
    diff, half = t_interval([y - x for x, y in zip(labels[f"{key}_seeds"], retrieved[f"{key}_seeds"])])
    return f"{_signed(diff)} ± {half:.3f}"


def nih_retrieved_sentence(res: dict) -> str:
    """configs/experiments/nih-retrieved.yaml (issue 39 part 4): IU-retrieved captions vs label templates on NIH,
    the same teacher and seeds: each figure per arm (mean ± 95 % CI) and the paired per-seed difference."""
    labels, retrieved, seeds = _nih_retrieved_arms(res)

    def figure(key, name, prior=None):
        text = f"{name} {_ci(retrieved[f'{key}_seeds'])} vs {_ci(labels[f'{key}_seeds'])} (paired " \
               f"{_paired(labels, retrieved, key)}"
        return text + (f"; train-box prior {labels[prior + '_seeds'][0]:.3f})" if prior else ")")

    def holds_chance(row):
        mean, half = t_interval(row["zero_shot_auc_mean_seeds"])
        return abs(mean - 0.5) <= half

    g = res["grounding"]["reinforced-retrieved"]
    n_images = {s["final"]["n_images"] for arm in ("reinforced-labels", "reinforced-retrieved") for s in res["runs"][arm]}
    at_chance = [name for name, row in (("labels", labels), ("retrieved", retrieved)) if holds_chance(row)]
    below = all(row[f"{k}_seeds"] and max(row[f"{k}_seeds"]) < row[f"{k}_train_prior_seeds"][0]
                for row in (labels, retrieved) for k in ("pg_z", "pg_attention"))
    return (f"On NIH ([recipe](configs/experiments/nih-retrieved.yaml), [results](docs/results/nih-retrieved.json)), "
            f"captions retrieved from the IU X-ray train reports against label templates, the same NIH-trained "
            f"teacher, seeds {_seed_span(seeds)}, {'/'.join(map(str, sorted(n_images)))} test images: "
            + "; ".join([figure("zero_shot_auc_mean", "zero-shot AUC (blind 0.5)"),
                         figure("pg_attention", "PG attention", "pg_attention_train_prior"),
                         figure("pg_z", "PG z", "pg_z_train_prior")])
            + f". The retrieved IU sentences assert a finding the image has {_pct(g['val']['hit_rate'])} of the time "
            f"on val, {_pct(g['test']['hit_rate'])} on test (bank base rate {_pct(g['test']['bank_base_rate'])})"
            + (f"; the zero-shot AUC interval holds chance for {' and '.join(at_chance)}" if at_chance else "")
            + ("; every seed of both arms points below the train-box prior (z and attention)" if below else "") + ".")


def nih_retrieved_table(res: dict) -> list[str]:
    """docs/real-radiographs.md's table of configs/experiments/nih-retrieved.yaml: each arm (mean ± 95 % CI over
    seeds), the paired per-seed difference, chance and the train-box prior, and the retrieval grounding."""
    labels, retrieved, _ = _nih_retrieved_arms(res)
    lines = ["| figure (NIH test) | label templates | IU-retrieved | paired retrieved − labels | chance | train-box prior |",
             "|---|---|---|---|---|---|"]
    for key, name, chance, prior in (
            ("zero_shot_auc_mean", "zero-shot AUC, mean of the 8 findings", None, None),
            ("pg_attention", "pointing game, word attention", "pg_attention_chance", "pg_attention_train_prior"),
            ("pg_z", "pointing game, mask z", "pg_z_chance", "pg_z_train_prior"),
            ("mean_recall", "retrieval mean R (label-composed texts)", "chance_mean_recall", None),
            ("probe_auc", "linear probe AUC", None, None)):
        blind = "0.5" if key == "zero_shot_auc_mean" else "–"
        lines.append(f"| {name} | {_ci(labels[f'{key}_seeds'])} | {_ci(retrieved[f'{key}_seeds'])} | "
                     f"{_paired(labels, retrieved, key)} | "
                     f"{_ci(labels[chance + '_seeds']) if chance else blind} | "
                     f"{_ci(labels[prior + '_seeds']) if prior else '–'} |")
    g = res["grounding"]["reinforced-retrieved"]
    lines += ["", "Retrieved IU sentences that assert a finding the image has (its NIH labels), against a sentence drawn "
                  "at random from the bank: " + "; ".join(
                      f"{split} {_pct(g[split]['hit_rate'])} vs {_pct(g[split]['bank_base_rate'])} "
                      f"({g[split]['asserting_a_finding']:,} of {g[split]['retrieved_sentences']:,} retrieved sentences "
                      f"assert one)" for split in ("train", "val", "test")) + "."]
    return lines


def _pct(v: float) -> str:
    return f"{100 * v:.0f} %"


# --------------------------------------------------------------------------- provenance


def _leaves(obj, prefix: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


def recipe_settings() -> dict[str, list[tuple[str, object]]]:
    """recipe file stem -> [(dotted key, value)] for every leaf setting of configs/experiments/*.yaml."""
    return {p.stem: list(_leaves(safe_load(p.read_text()) or {})) for p in sorted(RECIPES.glob("*.yaml"))}


def provenance_entries() -> list[dict]:
    return safe_load(PROVENANCE.read_text())["settings"]


def provenance_match(recipe: str, key: str, entries: list[dict] | None = None) -> dict | None:
    """The first entry whose `recipes` holds the recipe (or '*') and one of whose `keys` globs the key."""
    for entry in entries if entries is not None else provenance_entries():
        recipes = entry.get("recipes", ["*"])
        if ("*" in recipes or recipe in recipes) and any(fnmatch.fnmatchcase(key, k) for k in entry["keys"]):
            return entry
    return None


def _value(v) -> str:
    if isinstance(v, float) and v != 0 and (abs(v) < 1e-2):
        return f"{v:g}"
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else str(v)


def provenance_table() -> list[str]:
    entries = provenance_entries()
    matched: dict[int, dict[str, list[str]]] = {}
    for recipe, settings in recipe_settings().items():
        for key, value in settings:
            entry = provenance_match(recipe, key, entries)
            if entry is None:
                raise KeyError(f"{recipe}.yaml: {key} has no row in {PROVENANCE.relative_to(ROOT)}")
            matched.setdefault(entries.index(entry), {}).setdefault(recipe, []).append(f"`{key}` {_value(value)}")
    lines = ["| settings (recipe: `key` value) | chosen on | how |", "|---|---|---|"]
    for i, entry in enumerate(entries):
        if i not in matched:
            continue
        cell = "<br>".join(f"*{recipe}*: " + ", ".join(items) for recipe, items in matched[i].items())
        lines.append(f"| {cell} | {entry['chosen_on']} | {entry['how']} |")
    return lines


# --------------------------------------------------------------------------- blocks


BLOCKS = {
    "efficiency": lambda: efficiency(_load(EFFICIENCY)),
    "gpu-efficiency": gpu_efficiency,
    "efficiency-reading": lambda: efficiency_reading(_load(EFFICIENCY)),
    "efficiency-caveats": lambda: efficiency_caveats(_load(EFFICIENCY)),
    "controls-table": lambda: controls_table(_load(CONTROLS)),
    "limitations-controls": lambda: ["  " + readme_controls(_load(CONTROLS), root="../", docs="")],
    "limitations-ladder": lambda: limitations_ladder(_load(LADDER)),
    "controls-reading": lambda: controls_reading(_load(CONTROLS)),
    "controls-reinforced-minilm": lambda: controls_reinforced_minilm(_load(CONTROLS_MINILM), _load(CONTROLS)),
    "controls-distill-probe": lambda: controls_distill_probe(_load(DISTILL_PROBE), _load(CONTROLS_MINILM),
                                                             _load(CONTROLS)),
    "controls-strong-teacher": lambda: controls_strong_teacher(_load(CONTROLS_STRONG), _load(CONTROLS),
                                                               _load(TEACHER_REPORT)),
    "controls-strong-minilm": lambda: controls_strong_minilm(_load(CONTROLS_STRONG_MINILM), _load(CONTROLS_MINILM),
                                                             _load(TEACHER_REPORT)),
    "readme-efficiency": lambda: readme_efficiency(_load(EFFICIENCY)),
    "ladder": lambda: ladder(_load(LADDER)),
    "ladder-margins": lambda: ladder_margins(_load(LADDER)),
    "ladder-reading": lambda: ladder_reading(_load(LADDER)),
    "readme-ladder": lambda: readme_ladder(_load(LADDER)),
    "nih-readme": readme_nih,
    "nih-table": nih_table,
    "nih-findings": nih_findings,
    "nih-bars": nih_bars,
    "nih-efficiency": nih_efficiency,
    "nih-reading": nih_reading,
    "nih-iobb": nih_iobb,
    "nih-shift": nih_shift,
    "provenance": provenance_table,
    "nih-retrieved-table": lambda: nih_retrieved_table(_load(NIH_RETRIEVED)),
    "readme-image-only": lambda: [readme_image_only(_load(IMAGE_ONLY))[0] + " " + nih_retrieved_sentence(_load(NIH_RETRIEVED))],
}


@functools.lru_cache(maxsize=None)
def render(name: str) -> str:
    return "\n".join(BLOCKS[name]()) + "\n"


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def stale_blocks() -> list[str]:
    out = []
    for page in PAGES:
        for m in BLOCK.finditer(page.read_text()):
            if m.group(3) != render(m.group(2)):
                out.append(f"{page.relative_to(ROOT)}: {m.group(2)}")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--derive"]:
        CHECKS.write_text(json.dumps(derive_checks(_load(EFFICIENCY)), indent=1) + "\n")
        return 0
    if argv[:1] == ["--write"]:
        for page in PAGES:
            text = page.read_text()
            new = rewrite(text)
            if new != text:
                page.write_text(new)
                print(f"rewrote {page.relative_to(ROOT)}")
        return 0
    if argv[:1] == ["--check"]:
        stale = stale_blocks()
        print("\n".join(stale) or "every generated block matches the results")
        return 1 if stale else 0
    eff = Path(argv[0] if argv else EFFICIENCY)
    lad = Path(argv[1] if len(argv) > 1 else LADDER)
    out = []
    if eff.is_file():
        out += efficiency(json.loads(eff.read_text())) + [""]
    if lad.is_file():
        out += ladder(json.loads(lad.read_text())) + [""] + ladder_margins(json.loads(lad.read_text()))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
