"""Scores of one heatmap against the radiologists' boxes, and the image-blind box-frequency prior.

A heatmap lives on the model's patch grid of the full-image view (identity params). Per target:
- pointing game: the map's maximum inside the target's patches (``localisation.pointing_hit``);
- IoU of its top 20 % cells with the target's patches (``localisation.localisation_scores``);
- Wang et al. (2017)'s localisation accuracy at T(IoBB): the map, min-max scaled, is thresholded at
  ``threshold``; the connected region holding its peak gives one box (in image pixels); a hit when
  IoBB = |box ∩ ground-truth box| / |box| exceeds T for some ground-truth box of the target.
"""
from __future__ import annotations

import numpy as np
from scipy import ndimage

from cxrdr.common.augment import view_to_image
from cxrdr.train.evaluation import localisation as loc

IOBB_T = (0.1, 0.25, 0.5)


def heat_box(heat, params: dict, threshold: float = 0.5) -> list[float] | None:
    """Pixel box [x0, y0, x1, y1] of the thresholded region around the map's peak (None for an empty map)."""
    h = np.asarray(heat, dtype=np.float64)
    if not np.isfinite(h).any():
        return None
    lo, hi = np.nanmin(h), np.nanmax(h)
    scaled = np.nan_to_num((h - lo) / (hi - lo) if hi > lo else np.ones_like(h), nan=0.0)
    regions, _ = ndimage.label(scaled >= threshold)
    peak = np.unravel_index(int(np.nanargmax(h)), h.shape)
    rows, cols = np.nonzero(regions == regions[peak])
    gh, gw = h.shape
    corners = np.array([[cols.min() / gw * 2 - 1, rows.min() / gh * 2 - 1],
                        [(cols.max() + 1) / gw * 2 - 1, (rows.max() + 1) / gh * 2 - 1]])
    (x0, y0), (x1, y1) = view_to_image(params, corners)
    return [min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)]


def iobb(pred: list[float], gt: list[float]) -> float:
    """Intersection over the detected box's area (Wang et al. 2017)."""
    ix = max(0.0, min(pred[2], gt[2]) - max(pred[0], gt[0]))
    iy = max(0.0, min(pred[3], gt[3]) - max(pred[1], gt[1]))
    area = (pred[2] - pred[0]) * (pred[3] - pred[1])
    return ix * iy / area if area > 0 else 0.0


def score_map(heat, target, gt_boxes: list, params: dict, top_fraction: float = 0.2) -> dict:
    """Pointing hit, top-fraction IoU and T(IoBB) hits of one heatmap for one target."""
    s = loc.localisation_scores(heat, target, top_fraction)
    box = heat_box(heat, params)
    best = max((iobb(box, g) for g in gt_boxes), default=0.0) if box is not None else 0.0
    return {"hit": float(s["hit"]), "iou": s["iou"], **{f"iobb_{t}": float(best > t) for t in IOBB_T}}


def chance_map_scores(target, gt_boxes: list, params: dict, top_fraction: float = 0.2, draws: int = 32,
                      seed: int = 0) -> dict:
    """Expected scores of a uniformly random heatmap: exact for the pointing game and IoU
    (``localisation.chance_scores``), by ``draws`` seeded random maps for T(IoBB)."""
    exact = loc.chance_scores(target, top_fraction)
    rng = np.random.default_rng(seed)
    grid = np.asarray(target).shape
    sims = [score_map(rng.random(grid), target, gt_boxes, params, top_fraction) for _ in range(draws)]
    return {"hit": exact["hit"], "iou": exact["iou"],
            **{f"iobb_{t}": float(np.mean([s[f"iobb_{t}"] for s in sims])) for t in IOBB_T}}


def loo_means(maps: list) -> list[np.ndarray]:
    """For each map, the mean of the others (the leave-one-out prior of ``localisation.prior_pointing_game``)."""
    stack = np.stack([np.nan_to_num(np.asarray(m, dtype=np.float64)) for m in maps])
    total = stack.sum(0)
    n = len(maps)
    return [(total - stack[i]) / (n - 1) if n > 1 else np.full(stack[i].shape, np.nan) for i in range(n)]
