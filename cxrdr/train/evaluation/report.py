"""Outputs of an evaluation or experiment: printed table, JSON, Markdown, PNG plots (Agg).

JSON never holds NaN (written as null) so any reader can load it; Markdown tables print
recalls, AUCs and similar fractions with three decimals, costs with one.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cxrdr.common.atomic import write_json_atomic, write_text_atomic
from cxrdr.common.plots import pyplot, save_figure

# column -> header used in every table; the summary keys of runner.summary_row
HEADERS = {
    "i2t_R@1": "i2t R@1", "i2t_R@5": "i2t R@5", "i2t_R@10": "i2t R@10",
    "t2i_R@1": "t2i R@1", "t2i_R@5": "t2i R@5", "t2i_R@10": "t2i R@10",
    "mean_recall": "mean R", "mean_recall_sametext": "mean R (same text)", "n_candidates": "N cand",
    "probe_auc": "probe AUC", "probe_ap": "probe AP", "zeroshot_auc": "0-shot AUC",
    "zeroshot_5x200_acc": "5x200 acc", "pointing_z": "PG z", "iou_z": "IoU z", "dice_z": "Dice z",
    "pointing_attn": "PG attn", "chance_pointing_z": "PG z chance", "prior_pointing_z": "PG z prior",
    "chance_pointing_attn": "PG attn chance", "prior_pointing_attn": "PG attn prior",
    "chance_mean_recall": "mean R chance", "iou_attn": "IoU attn", "deletion_auc": "del AUC",
    "insertion_auc": "ins AUC", "sparsity": "z>0.5", "cross_view_jaccard": "xview J",
    "distance_ratio": "intra/inter", "inference_img_per_s": "infer img/s",
    "train_step_ms": "synth step ms", "latency_ms": "latency ms", "peak_memory_mb": "peak MB",
    "gflops_per_img": "GFLOPs/img", "patch_usage_pct": "patch use %",
    "train_img_per_s": "train img/s", "wall_s": "wall s", "samples_seen": "samples", "step_ms": "loop step ms", "bench_step_ms": "bench step ms",
    "k_ratio": "k_ratio", "synthetic_train_img_per_s": "synth train img/s",
    "mean_recall_x_chance": "mean R / chance", "pointing_z_x_chance": "PG z / chance",
    "pointing_attn_x_chance": "PG attn / chance", "step_memory_delta_mb": "step +MB",
    "mean_recall_findings": "mean R (same findings)", "oracle_mean_recall": "mean R oracle",
    "train_prior_pointing_z": "PG z train prior", "train_prior_pointing_attn": "PG attn train prior",
    "pointing_z_pathology": "PG z pathology", "train_prior_pointing_z_pathology": "PG z path. train prior",
    "margin_z_train_prior": "PG z − train prior", "margin_z_pathology_train_prior": "PG z path. − train prior",
    "margin_attn_train_prior": "PG attn − train prior",
}
# paired margins (model − baseline): printed with their sign
SIGNED_COLUMNS = {"margin", "margin_z_train_prior", "margin_z_pathology_train_prior", "margin_attn_train_prior"}
QUALITY_COLUMNS = ["i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mean_recall",
                   "chance_mean_recall", "oracle_mean_recall", "mean_recall_sametext", "mean_recall_findings",
                   "n_candidates", "probe_auc", "zeroshot_auc",
                   "pointing_z", "chance_pointing_z", "prior_pointing_z", "train_prior_pointing_z",
                   "margin_z_train_prior", "iou_z",
                   "pointing_z_pathology", "train_prior_pointing_z_pathology", "margin_z_pathology_train_prior",
                   "pointing_attn", "chance_pointing_attn", "prior_pointing_attn", "train_prior_pointing_attn",
                   "margin_attn_train_prior", "iou_attn", "distance_ratio"]
COST_COLUMNS = ["inference_img_per_s", "train_step_ms", "synthetic_train_img_per_s", "latency_ms", "peak_memory_mb",
                "step_memory_delta_mb", "gflops_per_img", "patch_usage_pct"]


def jsonable(obj):
    """Recursively: NaN/inf -> None, numpy -> Python, tuples -> lists, unknown -> str."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return None if not math.isfinite(float(obj)) else float(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def write_json(obj, path: Path) -> None:
    """``obj`` as JSON (``jsonable``) to ``path``, whole: an eval.json marks an evaluation as made."""
    write_json_atomic(path, jsonable(obj), indent=2, fsync=False, trailing_newline=True)


def fmt(value, column: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if column in SIGNED_COLUMNS:
            return f"{v:+.3f}"
        costly = column in COST_COLUMNS or column in ("train_img_per_s", "wall_s", "step_ms", "bench_step_ms")
        if costly and 0 < abs(v) < 1:
            return f"{v:.3g}"  # e.g. GFLOPs of tiny models
        return f"{v:.1f}" if costly or abs(v) >= 10 else f"{v:.3f}"
    return str(value)


def fmt_interval(value, interval, column: str = "") -> str:
    """'value [lo, hi]' (an interval over images, e.g. a pointing game's bootstrap), or ``fmt(value)``
    alone where there is no interval."""
    if not isinstance(interval, (list, tuple)) or len(interval) != 2 or any(v is None for v in interval):
        return fmt(value, column)
    lo, hi = (fmt(v, column) for v in interval)
    return f"{fmt(value, column)} [{lo}, {hi}]"


def cell(row: dict, column: str) -> str:
    """A table cell: the column's value, with its ``<column>_interval`` beside it where the row has one."""
    return fmt_interval(row.get(column), row.get(f"{column}_interval"), column)


def markdown_table(rows: list[dict], columns: list[str], first: str | None = None) -> str:
    """Rows as a Markdown table; ``first`` names the row-label key (printed as the first column). A column
    with a ``<column>_interval`` in the row prints as 'value [lo, hi]'."""
    cols = ([first] if first else []) + [c for c in columns if c != first]
    lines = ["| " + " | ".join(HEADERS.get(c, c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, c) for c in cols) + " |")
    return "\n".join(lines)


def seed_summary(label: str, rows: list[dict], columns: list[str]) -> dict:
    """One row over seeds: each column's mean, its sample sd (``<col>_sd``) and the values (``<col>_seeds``)."""
    out: dict = {"run": label, "n_seeds": len(rows)}
    for col in columns:
        values = [float(r[col]) for r in rows if r.get(col) is not None and math.isfinite(float(r[col]))]
        out[col] = float(np.mean(values)) if values else None
        out[f"{col}_sd"] = float(np.std(values, ddof=1)) if len(values) > 1 else None
        out[f"{col}_seeds"] = values
    return out


def markdown_table_sd(rows: list[dict], columns: list[str], first: str = "run", spread: str = "sd") -> str:
    """Like ``markdown_table``, cells as 'mean ± sd' where a ``<col>_sd`` is present (``spread="ci"``:
    'mean ± <col>_ci', e.g. a 95 % t-interval half-width)."""
    cols = [first] + [c for c in columns if c != first]
    lines = ["| " + " | ".join(HEADERS.get(c, c) for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        cells = []
        for c in cols:
            sd = row.get(f"{c}_{spread}")
            if isinstance(sd, (list, tuple)):  # an interval (e.g. a bootstrap's), not a half-width
                lo, hi = ("inf" if isinstance(v, float) and math.isinf(v) else fmt(v, c) for v in sd)
                cells.append(f"{fmt(row.get(c), c)} [{lo}, {hi}]")
            else:
                cells.append(fmt(row.get(c), c) + (f" ± {fmt(sd, c)}" if sd is not None else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- eval outputs


def eval_markdown(results: dict) -> str:
    meta = results["meta"]
    s = results["summary"]
    out = [f"# Evaluation of `{meta['model']}`", "",
           f"- shards: `{meta['shards']}`, split **{meta['split']}**, {meta['n_samples']} images",
           f"- retrieval text: **{meta['text_section']}** (findings+impression when 'both'; "
           f"{meta['text_section_fallbacks_to_report']} studies fell back to the stored report)",
           f"- images: {meta['image_view']} ({meta['image_size']} px)",
           "- exact ids of every evaluation set: `eval_ids.json`", ""]
    r = results.get("retrieval", {})
    out += ["## Retrieval", "",
            f"{r.get('n_candidates')} candidates ({r.get('candidates')}); "
            f"{r.get('n_unique_texts')} distinct texts. 'same text' counts identical reports as correct.", "",
            f"Strict mean R **{fmt(r.get('mean_recall'))}** (chance {fmt(r.get('chance_mean_recall'))}, "
            f"findings-oracle ceiling {fmt(r.get('oracle_mean_recall'))}: a model that knows each study's "
            f"findings and nothing else); same findings counted correct **{fmt(r.get('mean_recall_findings'))}** "
            f"({r.get('n_finding_sets')} finding sets).", "",
            "| direction | R@1 | R@5 | R@10 | median rank | R@1 same text | R@5 same text | R@10 same text |",
            "|---|---|---|---|---|---|---|---|"]
    for d in ("i2t", "t2i"):
        out.append(f"| {d} | " + " | ".join(fmt(r.get(k)) for k in (
            f"{d}_R@1", f"{d}_R@5", f"{d}_R@10", f"{d}_median_rank", f"{d}_R@1_sametext",
            f"{d}_R@5_sametext", f"{d}_R@10_sametext")) + " |")
    out.append("")
    for key, title in (("probe", "Linear probe (train -> test)"), ("zeroshot", "Zero-shot prompts")):
        p = results.get(key)
        if not p:
            continue
        out += [f"## {title}", ""]
        if isinstance(p.get("skipped"), str):
            out += [f"skipped: {p['skipped']}", ""]
            continue
        out += [f"mean AUC **{fmt(p.get('mean_auc'))}**, mean AP **{fmt(p.get('mean_ap'))}** over "
                f"{p.get('n_labels')} labels", "", "| label | AUC | AP | positives |", "|---|---|---|---|"]
        for name, v in p.get("per_label", {}).items():
            out.append(f"| {name} | {fmt(v['auc'])} | {fmt(v['ap'])} | {v['n_pos']}/{v['n']} |")
        if p.get("skipped"):
            out += ["", "Skipped (fewer than %s positives or no negatives): " % p.get("min_positives", 5)
                    + "; ".join(f"{k} ({v})" for k, v in p["skipped"].items())]
        out.append("")
    z5 = results.get("zeroshot_5x200")
    if z5:
        out += ["## Zero-shot 5x200-style", "",
                f"accuracy {fmt(z5.get('accuracy'))} on {z5.get('n')} images "
                f"({z5.get('per_class_n')}; seeded subset, ids in eval_ids.json)", ""]
    lo = results.get("localisation")
    if lo:
        out += localisation_markdown(lo)
    fa = results.get("faithfulness")
    if fa:
        out += ["## Mask faithfulness", "",
                f"{fa['n_images']} images, order from {', '.join(fa['order_source']) or '–'}; "
                f"baseline {fa['baseline']}.", "",
                "| deletion AUC (lower better) | insertion AUC (higher better) | random deletion | "
                "random insertion | sparsity z>0.5 | spatial entropy | cross-view Jaccard |",
                "|---|---|---|---|---|---|---|",
                "| " + " | ".join(fmt(fa.get(k)) for k in (
                    "deletion_auc", "insertion_auc", "random_deletion_auc", "random_insertion_auc",
                    "sparsity", "spatial_entropy", "cross_view_jaccard")) + " |", ""]
    g = results.get("geometry")
    if g:
        out += ["## Embedding geometry", "",
                f"intra-subject {fmt(g['intra'])} / inter-subject {fmt(g['inter'])} = ratio "
                f"**{fmt(g['ratio'])}** ({g['n_subjects']} subjects, {g['n_intra_pairs']} intra pairs)", ""]
    e = results.get("efficiency")
    if e:
        out += ["## Efficiency", "", "| " + " | ".join(k for k in e) + " |",
                "|" + "|".join("---" for _ in e) + "|",
                "| " + " | ".join(fmt(v, k) for k, v in e.items()) + " |", ""]
    files = results.get("files", {})
    figures = [f"![{name}]({files[key]})" for key, name in (("heatmaps_png", "heatmaps"),
                                                          ("deletion_insertion_png", "deletion/insertion"))
               if key in files]
    if figures:
        out += ["## Figures", "", *figures, ""]
    intervals = ("Localisation cells 'value [lo, hi]': 95 % interval over the evaluation images."
                 if any(k.endswith("_interval") and v for k, v in s.items()) else "")
    out += ["## Summary", "", markdown_table([s], [c for c in s if not c.endswith("_interval")]), intervals, ""]
    return "\n".join(out)


def print_summary(results: dict) -> None:
    s = results["summary"]
    cols = [c for c in QUALITY_COLUMNS + COST_COLUMNS if s.get(c) is not None]
    width = max(len(HEADERS.get(c, c)) for c in cols)
    print(f"evaluation of {results['meta']['model']} on {results['meta']['split']} "
          f"({results['meta']['n_samples']} images, text: {results['meta']['text_section']})")
    for c in cols:
        print(f"  {HEADERS.get(c, c):<{width}}  {cell(s, c)}")
    if any(s.get(f"{c}_interval") for c in cols):
        print("  [lo, hi]: 95 % interval over the evaluation images (bootstrap; an image's targets stay together)")


def write_eval_outputs(results: dict, ids: dict, plots: dict, out_dir: Path, quiet: bool = False) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"eval_json": "eval.json", "eval_md": "eval.md", "eval_ids": "eval_ids.json"}
    curves = (results.get("faithfulness") or {}).get("curves")
    if curves:
        plot_deletion_insertion(curves, out_dir / "deletion_insertion.png")
        files["deletion_insertion_png"] = "deletion_insertion.png"
    if plots.get("heatmaps"):
        plot_heatmap_grid(plots["heatmaps"], out_dir / "heatmaps.png")
        files["heatmaps_png"] = "heatmaps.png"
    results["files"] = files
    write_json(results, out_dir / "eval.json")
    write_json(ids, out_dir / "eval_ids.json")
    write_text_atomic(out_dir / "eval.md", eval_markdown(results))
    if not quiet:
        print_summary(results)
        print(f"wrote {out_dir}/eval.json, eval.md, eval_ids.json and {len(files) - 3} PNG(s)")


# --------------------------------------------------------------------------- plots


def _draw_boxes(ax, boxes, colour="lime"):
    from matplotlib.patches import Rectangle

    for _, (x0, y0, x1, y1) in boxes:
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor=colour, linewidth=1.2))


def plot_heatmap_grid(items: list[dict], path: Path, max_attn: int = 3) -> None:
    """One row per image: image + GT boxes, mask z's scores, attention of each finding's words; each map's
    peak (what the pointing game scores) is marked with a white cross.

    Drawn once (~1.0 -> ~0.45 s for 6 rows): fixed margins instead of ``tight_layout`` (another full draw of 30
    panels), each title a plain text (``set_title`` places itself by every axis' extent at each draw), the PNG
    compressed at level 1 (``save_figure``)."""
    plt = pyplot()
    ncols = 2 + max(1, min(max_attn, max((len(it["attn"]) for it in items), default=0)))
    fig, axes = plt.subplots(len(items), ncols, figsize=(2.2 * ncols, 2.2 * len(items)), squeeze=False)
    for r, it in enumerate(items):
        img = it["image"]
        size = img.shape[-1]
        extent = (0, size, size, 0)
        panels = [("image", None), ("mask z scores", it.get("z"))] + [
            (f"attn: {lab}", heat) for lab, heat in it["attn"][:max_attn]]
        for c in range(ncols):
            ax = axes[r][c]
            ax.axis("off")
            if c >= len(panels):
                continue
            title, heat = panels[c]
            ax.imshow(img, cmap="gray", extent=extent, vmin=0, vmax=1)
            if heat is not None:
                ax.imshow(np.nan_to_num(heat, nan=np.nanmin(heat)), cmap="jet", alpha=0.45, extent=extent,
                          interpolation="nearest")
                _mark_peak(ax, heat, size)
            elif c == 1:
                title = "mask z: none"
            _draw_boxes(ax, it["boxes"])
            ax.text(0.5, 1.02, title if c else f"{it['key'][:18]}", transform=ax.transAxes, ha="center",
                    va="bottom", fontsize=7)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - 0.3 / fig.get_figheight(), wspace=0.08,
                        hspace=0.15)
    save_figure(fig, path, tight=False)


def _mark_peak(ax, heat, size: int) -> None:
    """A white cross on the centre of the map's highest patch (NaN: dropped patches, ignored)."""
    heat = np.asarray(heat, dtype=np.float64)
    if not np.isfinite(heat).any():
        return
    row, col = np.unravel_index(int(np.nanargmax(heat)), heat.shape)
    gh, gw = heat.shape
    ax.plot([(col + 0.5) * size / gw], [(row + 0.5) * size / gh], marker="x", color="white", ms=6, mew=1.5)


def plot_deletion_insertion(curves: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    f = curves["fractions"]
    for ax, kind in zip(axes, ("deletion", "insertion")):
        ax.plot(f, curves[kind], "-o", ms=3, label="mask order")
        ax.plot(f, curves[f"random_{kind}"], "--", color="grey", label="random order")
        ax.set_xlabel(f"fraction of patches {'removed' if kind == 'deletion' else 'inserted'}")
        ax.set_ylabel("cos(image, own report)")
        ax.set_title(kind)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_series(series: dict, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    """Lines: {name: (xs, ys)}."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name, (xs, ys) in series.items():
        ys = [np.nan if y is None else y for y in ys]
        ax.plot(xs, ys, "-o", ms=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_bars(values: dict, ylabel: str, title: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(values)), 3.2))
    names = list(values)
    heights = [np.nan if values[n] is None else values[n] for n in names]
    bars = ax.bar(range(len(names)), heights, color="tab:blue")
    # long run names ("plain-total-samples") broken at their hyphens, or neighbouring labels run into each other
    ax.set_xticks(range(len(names)), [n.replace("-", "-\n") if len(n) > 12 else n for n in names], fontsize=8)
    for b, h in zip(bars, heights):
        if np.isfinite(h):
            ax.annotate(f"{h:.1f}", (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def localisation_markdown(lo: dict) -> list[str]:
    """The localisation section: each score beside a random heatmap's and the priors', each pointing game
    with its interval over images, the paired margin over the train-box prior, per label, collapse checks."""
    boot = lo.get("bootstrap") or {}
    out = ["## Localisation", "",
           f"{lo['n_images']} images with boxes; heatmap top {int(lo['top_fraction'] * 100)}% for IoU/Dice. "
           "Pointing game: a hit when the map's maximum is inside a target box (z: any box of the image; "
           "attention: the boxes of the finding its words name). *chance*: a uniformly random heatmap "
           "on the same grid and targets. *prior*: the pointing game of the mean map of the other images "
           "(the same map for every image: what a model that does not look at the image can score). "
           "*train prior*: one fixed map of how often each patch lies in a train-split box (z: any box; "
           "attention: that finding's boxes), the strongest image-blind baseline.", ""]
    if boot:
        out += [f"[lo, hi]: {round(100 * boot['confidence'])} % percentile-bootstrap interval over the evaluation "
                f"images ({boot['n_boot']:,} resamples, seed {boot['seed']}; an image's targets stay together). A "
                "prior's hit rate varies over images too. *− train prior*: the paired margin, model and prior "
                "scored on the same resampled images.", ""]
    out += ["| heatmap | pointing game | chance | x chance | prior | train prior | − train prior | IoU | "
            "chance IoU | Dice | targets | boxes |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def with_interval(a, figure, column=""):
        return fmt_interval(a.get(figure), a.get(f"{figure}_interval"), column)

    def margin(a):
        return with_interval(a, "margin_over_train_prior", "margin")

    def row(name, a):
        pg, ch = a.get("pointing_game"), a.get("chance_pointing_game")
        times = pg / ch if pg is not None and ch and math.isfinite(pg) else None
        return (f"| {name} | {with_interval(a, 'pointing_game')} | {with_interval(a, 'chance_pointing_game')} | "
                f"{fmt(times)} | {with_interval(a, 'prior_pointing_game')} | "
                f"{with_interval(a, 'train_prior_pointing_game')} | {margin(a)} | {fmt(a.get('iou'))} | "
                f"{fmt(a.get('chance_iou'))} | {fmt(a.get('dice'))} | {a.get('n', 0)} | {a.get('n_boxes', 0)} |")

    out.append(row("mask", lo["mask"]))
    if lo["mask"].get("pathology", {}).get("n"):
        out.append(row("mask, pathology boxes only", lo["mask"]["pathology"]))
    out.append(row("attention", lo["attention"]))
    if lo.get("per_label"):
        out += ["", "Per label (z: is the mask's peak on this finding; attention: of its words):", "",
                "| label | PG z | chance z | PG attn | chance attn | train prior attn | attn − train prior | "
                "IoU attn | targets attn |",
                "|---|---|---|---|---|---|---|---|---|"]
        for lab, d in lo["per_label"].items():
            m, a = d.get("mask", {}), d.get("attention", {})
            out.append(f"| {lab} | {with_interval(m, 'pointing_game')} | {fmt(m.get('chance_pointing_game'))} | "
                       f"{with_interval(a, 'pointing_game')} | {fmt(a.get('chance_pointing_game'))} | "
                       f"{with_interval(a, 'train_prior_pointing_game')} | {margin(a)} | {fmt(a.get('iou'))} | "
                       f"{a.get('n', 0)} |")
    m, a = lo["mask"], lo["attention"]
    out += ["", "Collapse checks (mean pairwise cosine of heatmaps; near 1 = the same map whatever the input; "
            "entropy / log cells, 1 = uniform):", "",
            "| map | across images | across words of one image | entropy |", "|---|---|---|---|",
            f"| mask z | {fmt(m.get('image_similarity'))} | – | {fmt(m.get('entropy'))} |",
            f"| attention | {fmt(a.get('image_similarity'))} | {fmt(a.get('word_similarity'))} | "
            f"{fmt(a.get('entropy'))} |"]
    if lo.get("boxes_without_finding_tokens"):
        out.append(f"\n{len(lo['boxes_without_finding_tokens'])} findings had no matching words in the "
                   "report (no attention heatmap).")
    out.append("")
    return out
