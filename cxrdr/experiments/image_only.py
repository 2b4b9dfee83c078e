"""The image-only judgement of an efficiency recipe (``efficiency.judge``; configs/experiments/image-only.yaml).

A recipe whose arms train on shards of the same source with the reports of some train studies hidden
(source options ``hide_reports`` + ``hidden``, cxrdr/reinforce/sources/hidden.py) names its roles::

    efficiency:
      judge:
        arm: reinforced-retrieved      # judged: all images, retrieved captions (a captioner build)
        baseline: plain-paired         # plain CLIP on the studies that kept their report
        ceiling: plain-all-reports     # plain CLIP with every report visible
        ceiling_fraction: 0.9          # arm's final >= this x the ceiling's
        sd_multiple: 2                 # arm - baseline > this x the baseline's seed sd

The bars (met True/False, margins always given) join the experiment's; ``image_only`` in results.json
adds per arm the final mean R, probe AUC and both pointing games each beside its train-box prior (seed mean
and sd, the report set), and, for every arm whose shards a retrieval captioner built, how often the
retrieved sentences assert a finding the image has against the bank's base rate, read with the true
labels of the recipe's training shards (the same source with every report visible: a hidden record's own
labels are hidden too).
"""
from __future__ import annotations

from pathlib import Path

from cxrdr.common.shards import iter_tar_samples, load_meta, read_dataset_info
from cxrdr.experiments.stats import mean_sd
from cxrdr.reinforce.captioners.grounding import shard_grounding

JUDGE_KEYS = {"arm", "baseline", "ceiling", "ceiling_fraction", "sd_multiple"}
# final summary columns reported per arm: (value, its baseline or None)
FIGURES = (("mean_recall", "chance_mean_recall"), ("probe_auc", None),
           ("pointing_z", "train_prior_pointing_z"), ("pointing_attn", "train_prior_pointing_attn"))


def _stats(values: list) -> dict:
    values = [v for v in values if v is not None]
    mean, sd = mean_sd(values)
    return {"mean": mean, "sd": sd, "seeds": values}


def arm_figures(trained: dict) -> dict:
    """arm -> figure -> seed mean/sd (and its baseline's), from every run's final evaluation."""
    out = {}
    for name, arm in trained.items():
        finals = [s["final"] for s in arm["seeds"]]
        row = {}
        for key, base in FIGURES:
            row[key] = _stats([f.get(key) for f in finals])
            if base:
                row[base] = _stats([f.get(base) for f in finals])
        out[name] = row
    return out


def judge_bars(judge: dict, figures: dict, metric: str = "mean_recall") -> list[dict]:
    """The two image-only bars with their margins (None where an arm is missing)."""
    unknown = sorted(set(judge) - JUDGE_KEYS)
    if unknown:
        raise ValueError(f"efficiency.judge: unknown key(s) {unknown}; known: {sorted(JUDGE_KEYS)}")
    arm, base, ceil = (figures.get(judge.get(k)) for k in ("arm", "baseline", "ceiling"))
    k, frac = float(judge.get("sd_multiple", 2)), float(judge.get("ceiling_fraction", 0.9))
    bars = []
    if arm and base:
        a, b = arm[metric], base[metric]
        gap = None if a["mean"] is None or b["mean"] is None else a["mean"] - b["mean"]
        limit = None if b["sd"] is None else k * b["sd"]
        bars.append({"bar": f"{judge['arm']} final {metric} - {judge['baseline']}'s > {k:g} sd of "
                            f"{judge['baseline']}'s seeds", "value": gap, "limit": limit,
                     "margin": None if gap is None or limit is None else gap - limit,
                     "met": None if gap is None or limit is None else gap > limit})
    if arm and ceil:
        a, c = arm[metric]["mean"], ceil[metric]["mean"]
        ratio = None if a is None or not c else a / c
        bars.append({"bar": f"{judge['arm']} final {metric} >= {frac:g} x {judge['ceiling']}'s", "value": ratio,
                     "limit": frac, "margin": None if ratio is None else ratio - frac,
                     "met": None if ratio is None else ratio >= frac})
    return bars


def true_labels(shards: Path) -> dict:
    """record id -> labels of every sample of a shard folder."""
    info = read_dataset_info(shards)
    out = {}
    for shard in info["shards"]:
        for _, raw in iter_tar_samples(Path(shards) / shard["name"]):
            meta = load_meta(raw["json"])
            out[meta["id"]] = meta.get("labels") or {}
    return out


def arm_grounding(trained: dict, labels_shards: Path) -> dict:
    """arm -> retrieval grounding (train split and all) for arms trained on a retrieval captioner's shards."""
    out, labels = {}, None
    for name, arm in trained.items():
        shards = Path(arm["seeds"][0]["train_config"]["shards"])
        if not (read_dataset_info(shards).get("captioner") or {}).get("bank"):
            continue
        labels = labels if labels is not None else true_labels(labels_shards)
        # val: no val study's report is in a train bank, so none can retrieve its own sentences
        out[name] = {"labels_from": str(labels_shards), "train": shard_grounding(shards, "train", labels),
                     "val": shard_grounding(shards, "val", labels), "all": shard_grounding(shards, None, labels)}
    return out


def image_only_results(judge: dict, trained: dict, labels_shards: Path, metric: str = "mean_recall") -> dict:
    figures = arm_figures(trained)
    return {"roles": judge, "figures": figures, "bars": judge_bars(judge, figures, metric),
            "grounding": arm_grounding(trained, labels_shards)}


def image_only_markdown(result: dict) -> list[str]:
    def fmt(s):
        return "-" if s["mean"] is None else f"{s['mean']:.3f} ± {s['sd'] or 0:.3f}"
    lines = ["", "## Image-only (efficiency.judge)", "",
             "| arm | mean R (chance) | probe AUC | PG z (train prior) | PG attn (train prior) |",
             "|---|---|---|---|---|"]
    for name, f in result["figures"].items():
        lines.append(f"| {name} | {fmt(f['mean_recall'])} ({fmt(f['chance_mean_recall'])}) | {fmt(f['probe_auc'])} "
                     f"| {fmt(f['pointing_z'])} ({fmt(f['train_prior_pointing_z'])}) | {fmt(f['pointing_attn'])} "
                     f"({fmt(f['train_prior_pointing_attn'])}) |")
    lines.append("")
    for bar in result["bars"]:
        value = "-" if bar["value"] is None else f"{bar['value']:.3f}"
        margin = "-" if bar["margin"] is None else f"{bar['margin']:+.3f}"
        lines.append(f"- {bar['bar']}: {value} (margin {margin}) -> "
                     f"{'met' if bar['met'] else 'missed' if bar['met'] is False else 'n/a'}")
    for name, g in result["grounding"].items():
        for split in ("train", "val"):
            t = g[split]
            lines.append(f"- {name} retrieved captions ({split}): {t['hit_rate']} assert a finding the image has "
                         f"vs bank base rate {t['bank_base_rate']} ({t['asserting_a_finding']} asserting sentences)")
    return lines
