"""`reinforce inspect DIR --views FILE.png`: one sample's stored augmentations, drawn.

The stored image with its finding boxes, then each of its K views replayed from the stored parameters
(``augment.replay_many``: the pixels the student trains on and every teacher embedded) with the boxes carried into
it through the same parameters (``augment.image_to_view``; a rotated view turns them). Under each view, for every
teacher with image embeddings, the rank of the sample's own report among the reports of its shard by that teacher's
stored embeddings: 1 is the teacher's first choice, about half the shard a teacher that sees nothing in the image.
Before hours of training it shows whether the crops keep the findings and whether a teacher's targets carry anything.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from cxrdr.common.augment import image_to_view, replay_many
from cxrdr.common.errors import UserError
from cxrdr.common.plots import pyplot, save_figure
from cxrdr.common.shards import Sample, decode_sample
from cxrdr.reinforce.teacher_check import own_ranks, stored_embeddings, unit

MAX_COLUMNS = 6
COLOURS = ("lime", "orange", "deepskyblue", "magenta", "yellow", "red", "cyan", "white")


def box_outline(params: dict, box, size: int) -> np.ndarray:
    """A stored-image box [x0, y0, x1, y1] as its closed outline (5, 2) in a view of ``size`` pixels, in
    imshow's coordinates (pixel j's centre at j). The corners go through ``image_to_view``, the map the
    localisation metrics use, so a rotated or flipped view turns the box with the image."""
    x0, y0, x1, y1 = box
    corners = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]], dtype=np.float64)
    return (image_to_view(params, corners) + 1) / 2 * size - 0.5


def report_ranks(shard: Path, sample: Sample, teachers: list[str]) -> dict[str, dict]:
    """For each of ``teachers`` whose stored embeddings have images: {"ranks": (K,) rank of the sample's own
    report among the shard's reports for each view (1 = first; reports scored alike tie in its favour),
    "cosines": (K,) the view's cosine to its own report, "n": reports ranked}."""
    texts: dict[str, list[np.ndarray]] = {t: [] for t in teachers}
    own: dict[str, int] = {}
    for other, by_teacher in stored_embeddings(shard, teachers):
        for t, parts in by_teacher.items():
            if other.key == sample.key:
                own[t] = len(texts[t])
            texts[t].append(parts["txt"])
    out = {}
    for t in teachers:
        parts = sample.embeddings(t) or {}
        if parts.get("img") is None or t not in own:
            continue
        reports = np.stack(texts[t])
        views = parts["img"]
        cosines = unit(views) @ unit(reports[own[t]])
        out[t] = {"ranks": own_ranks(views, reports, np.full(len(views), own[t])), "cosines": cosines,
                  "n": len(reports)}
    return out


def view_caption(params: dict, image_size) -> str:
    """'62 % crop, 3.2°, flip, b 1.05 c 0.93 g 1.10' (+ RandAugment op names) for a panel's title."""
    w, h = params["crop"][2:]
    area = 100 * w * h / (image_size[0] * image_size[1])
    bits = [f"{area:.0f} % crop", f"{params.get('angle', 0.0):+.1f}°"] + (["flip"] if params.get("hflip") else [])
    bits.append(f"b {params.get('brightness', 1):.2f} c {params.get('contrast', 1):.2f} g {params.get('gamma', 1):.2f}")
    bits += [name for name, _ in params.get("ops") or []]
    return ", ".join(bits)


def draw_views(shards_dir: Path, info: dict, shard_name: str, raw: dict, out: Path, size: int | None = None) -> dict:
    """Write the sample's views sheet to ``out`` (PNG); returns what it drew: the view size, each teacher's
    ranks and cosines. ``size``: the views' side in pixels (default: the first image teacher's input size, else
    the stored size). UserError for a sample without an image or without stored augmentations."""
    sample = decode_sample({"__url__": str(Path(shards_dir) / shard_name), **raw})
    params = sample.meta.get("aug") or []
    if sample.image_bytes is None or not params:
        raise UserError(f"sample {sample.key!r} in {shard_name}: no stored image or augmentations to draw "
                        "(a text-only build)")
    sizes = [t["image_size"] for t in info["teachers"] if t.get("image_size")]
    size = int(size or (sizes[0] if sizes else info["store_size"]))
    if size < 8:
        raise UserError(f"--view-size must be at least 8 pixels, got {size}")
    image = sample.image()
    views = replay_many(image, params, size)[:, 0].numpy()
    ranks = report_ranks(Path(shards_dir) / shard_name, sample, [t["name"] for t in info["teachers"]])
    _plot(np.asarray(image), views, sample, params, ranks, out)
    return {"key": sample.key, "size": size, "views": len(views),
            "ranks": {t: {"ranks": r["ranks"].tolist(), "cosines": r["cosines"].tolist(), "n": r["n"]}
                      for t, r in ranks.items()}}


def _plot(stored: np.ndarray, views: np.ndarray, sample: Sample, params: list[dict], ranks: dict, out: Path) -> None:
    plt = pyplot()
    panels = 1 + len(views)
    cols = min(MAX_COLUMNS, panels)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.9 * rows + 0.9), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    boxes = sample.meta.get("boxes") or []
    labels = sorted({b.get("label", "?") for b in boxes})
    colours = {label: COLOURS[i % len(COLOURS)] for i, label in enumerate(labels)}
    ax = axes[0, 0]
    ax.imshow(stored, cmap="gray", vmin=0, vmax=255)
    for b in boxes:
        x0, y0, x1, y1 = np.asarray(b["box"], dtype=np.float64) - 0.5
        ax.plot([x0, x1, x1, x0, x0], [y0, y0, y1, y1, y0], color=colours[b.get("label", "?")], linewidth=1)
    ax.set_title(f"stored {stored.shape[1]}x{stored.shape[0]}, {len(boxes)} finding box(es)", fontsize=6)
    if labels:
        handles = [plt.Line2D([], [], color=colours[label], label=label) for label in labels]
        ax.legend(handles=handles, fontsize=5, loc="lower center", bbox_to_anchor=(0.5, -0.02), ncol=2,
                  framealpha=0.7)
    for k, (view, p) in enumerate(zip(views, params)):
        ax = axes.ravel()[k + 1]
        ax.imshow(view, cmap="gray", vmin=0, vmax=1)
        for b in boxes:
            outline = box_outline(p, b["box"], view.shape[0])
            ax.plot(outline[:, 0], outline[:, 1], color=colours[b.get("label", "?")], linewidth=1)
        ax.set_xlim(-0.5, view.shape[1] - 0.5)
        ax.set_ylim(view.shape[0] - 0.5, -0.5)
        lines = [f"view {k}: " + view_caption(p, sample.meta.get("image_size") or stored.shape[::-1])]
        lines += [f"{t}: report #{r['ranks'][k]} of {r['n']} (cos {r['cosines'][k]:.2f})" for t, r in ranks.items()]
        ax.set_title("\n".join(textwrap.fill(line, 60) for line in lines), fontsize=6)
    head = (f"{sample.key} ({sample.meta.get('split')}): its stored views as the student replays them; "
            "#: the rank of its report among its shard's reports by each teacher's stored embeddings (1 = first)")
    fig.suptitle(head + "\n" + textwrap.fill("report: " + sample.report[:400], 170), fontsize=7, x=0.01,
                 horizontalalignment="left")
    save_figure(fig, out)
