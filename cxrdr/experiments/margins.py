"""Pointing games judged against the train-box prior over an arm's seeds (issue 37 part 4).

Every run of an arm is evaluated on the same images, and its evaluation keeps each target's hit beside the
train-box prior's hit on that target, with the target's image key (``eval.json`` ``localisation.hits`` on the
phantom; ``benchmark.json`` ``localisation.per_target`` on NIH). ``pooled_margins`` turns those lists into the
paired margin PG − train prior per figure, pooled over seeds, with two intervals
(``bootstrap.pooled_paired_margin``): over the evaluation images only, and over images and seeds together.
Results files keep these under ``margins_over_train_prior`` (arm -> figure -> margin).
"""
from __future__ import annotations

import json
from pathlib import Path

from cxrdr.train.evaluation import bootstrap

# figure (a results table's column) -> the block of eval.json localisation.hits it averages
EVAL_BLOCKS = {"pointing_z": "mask", "pointing_z_pathology": "mask_pathology", "pointing_attn": "attention"}
# figure (the box benchmark's summary column) -> the block of benchmark.json localisation.per_target
BENCHMARK_BLOCKS = {"pg_z": "mask", "pg_attention": "attention"}


def eval_hit_blocks(results: dict) -> dict[str, dict]:
    """figure -> ``{keys, model, train_prior}`` per-target lists of one run's evaluation (the results of
    ``evaluate``, i.e. eval.json); with a box benchmark beside it (``results['benchmark']['dir']``), its
    figures too. Figures the evaluation did not score (no boxes, no train prior) are left out."""
    hits = (results.get("localisation") or {}).get("hits") or {}
    out = {fig: hits[block] for fig, block in EVAL_BLOCKS.items()
           if isinstance(hits.get(block), dict) and hits[block].get("keys") and "train_prior" in hits[block]}
    bench_dir = (results.get("benchmark") or {}).get("dir")
    if bench_dir:
        path = Path(bench_dir) / "benchmark.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the run's box benchmark is named in its eval.json but missing; "
                                    "evaluate the run again")
        out.update(benchmark_hit_blocks(json.loads(path.read_text())))
    return out


def benchmark_hit_blocks(bench: dict) -> dict[str, dict]:
    """figure -> ``{keys, model, train_prior}`` of a box benchmark's per-target scores (benchmark.json)."""
    per_target = (bench.get("localisation") or {}).get("per_target") or {}
    out = {}
    for fig, block in BENCHMARK_BLOCKS.items():
        scored = per_target.get(block) or []
        if scored:
            out[fig] = {"keys": [s["key"] for s in scored], "model": [s["model"]["hit"] for s in scored],
                        "train_prior": [s["train_prior"]["hit"] for s in scored]}
    return out


def pooled_margins(per_seed: list[dict[str, dict]]) -> dict[str, dict]:
    """figure -> PG − train-box prior pooled over the seeds (``bootstrap.pooled_paired_margin``), for every
    figure that each seed's hit blocks hold; {} without seeds."""
    if not per_seed:
        return {}
    figures = [f for f in per_seed[0] if all(f in blocks for blocks in per_seed)]
    return {fig: bootstrap.pooled_paired_margin([blocks[fig] for blocks in per_seed]) for fig in figures}


def _signed(v) -> str:
    return "n/a" if v is None else f"{v:+.3f}"


def _interval(iv) -> str:
    return "[n/a]" if not iv or iv[0] is None else f"[{iv[0]:+.3f}, {iv[1]:+.3f}]"


def margins_markdown(margins: dict[str, dict[str, dict]],
                     heading: str = "## Pointing games − train-box prior (paired, pooled over seeds)") -> list[str]:
    """A table of every arm's pooled margins (rows arm x figure) under ``heading``; [] when there are none."""
    rows = [(arm, fig, m) for arm, figs in margins.items() for fig, m in figs.items()]
    if not rows:
        return []
    lines = [heading, "",
             "Each seed's PG − train-box prior on the same targets, averaged over seeds; 95 % percentile-bootstrap "
             "intervals over the evaluation images (seeds fixed) and over images and seeds together (the one to "
             "judge by; coarse with few seeds).", "",
             "| arm | figure | seeds | images | margin | over images | over images and seeds | per seed |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, fig, m in rows:
        per_seed = ", ".join(_signed(s["margin"]) for s in m["per_seed"])
        lines.append(f"| {arm} | {fig} | {m['n_seeds']} | {m['n_images']} | {_signed(m['margin'])} | "
                     f"{_interval(m['interval_images'])} | {_interval(m['interval'])} | {per_seed} |")
    return lines + [""]
