"""benchmark.json, benchmark.md (per-finding and overall tables, every score beside its baselines, the prompts)
and heatmaps.png of one benchmark run."""
from __future__ import annotations

from pathlib import Path

from cxrdr.common.atomic import write_text_atomic
from cxrdr.common.nih import BOX_FINDINGS
from cxrdr.train.evaluation.report import fmt, fmt_interval, plot_heatmap_grid, write_json

_COLS = ("model", "chance", "loo_prior", "train_prior")


def _cells(block: dict, metric: str) -> list[str]:
    return [fmt((block.get(b) or {}).get(metric)) for b in _COLS]


def _pos(v: dict | None) -> str:
    return f"{v['n_pos']} / {v['n']}" if v else ""


def localisation_table(block: dict, title: str) -> list[str]:
    """One table per heatmap: per finding and overall, each metric as model / chance / LOO prior / train prior."""
    head = ["finding", "n targets", "n boxes"] + [f"{m} (model / chance / LOO / train prior)"
                                                  for m in ("PG", "IoU top-20%", "T(IoBB)>0.1", "T(IoBB)>0.25",
                                                            "T(IoBB)>0.5")] + ["PG model [95 %]",
                                                                               "PG − train prior [95 %]"]
    out = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(f, block["per_finding"].get(f) or {}) for f in BOX_FINDINGS] + [("**overall**", block["overall"])]
    for name, b in rows:
        cells = [" / ".join(_cells(b, m)) for m in ("hit", "iou", "iobb_0.1", "iobb_0.25", "iobb_0.5")]
        model, margin = b.get("model") or {}, b.get("margin_over_train_prior") or {}
        cells += [fmt_interval(model.get("hit"), model.get("hit_interval")),
                  fmt_interval(margin.get("hit"), margin.get("hit_interval"), "margin")]
        out.append(f"| {name} | {b.get('n', 0)} | {b.get('n_boxes', 0)} | " + " | ".join(cells) + " |")
    return out + ["", "[95 %]: percentile-bootstrap interval over the images (2,000 resamples; an image's targets "
                      "stay together); the margin scores model and train prior on the same resampled images.", ""]


def benchmark_markdown(results: dict) -> str:
    meta, zs = results["meta"], results["zeroshot"]
    out = [f"# NIH ChestX-ray14 box benchmark: {meta['model']}", "",
           f"{meta['benchmark']}, split `{meta['split']}`: {meta['n_images']} images, {meta['n_boxes']} boxes; "
           f"model input {meta['image_size']} px; {meta['seconds']} s.", "",
           "## Zero-shot AUC (image-blind 0.5)", "", "| finding | AUC | positives / images |", "|---|---|---|"]
    for f in BOX_FINDINGS:
        v = zs["per_finding"].get(f)
        out.append(f"| {f} | {fmt(v['auc']) if v else 'n/a'} | {_pos(v)} |")
    out += [f"| **mean** | **{fmt(zs['mean_auc'])}** | |", ""]
    lo = results.get("localisation")
    if lo and "mask" in lo:
        out += ["## Localisation", "",
                f"Grid {lo['grid'][0]}x{lo['grid'][1]}. Baselines: " + "; ".join(f"{k}: {v}" for k, v in
                                                                                   lo["baselines"].items()) + ".",
                f"Map similarity across images (1 = one map for all): z {fmt(lo['mask']['image_similarity'])}, "
                f"attention {fmt(lo['attention']['image_similarity'])}.", ""]
        out += localisation_table(lo["mask"], "Mask z (target: any box of the image; per finding: that finding's boxes)")
        out += localisation_table(lo["attention"], "Attention of the finding's words (target: that finding's boxes)")
    out += ["## Prompts (zero-shot: positive minus negative; attention: the first positive's finding words "
            "in `findings of <finding>.`)", ""]
    out += [f"- {f}: +{p['positive']} −{p['negative']}" for f, p in zs["prompts"].items()]
    return "\n".join(out) + "\n"


def write_outputs(results: dict, plots: list, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(results, out_dir / "benchmark.json")
    write_text_atomic(out_dir / "benchmark.md", benchmark_markdown(results))
    if plots:
        plot_heatmap_grid(plots, out_dir / "heatmaps.png")
