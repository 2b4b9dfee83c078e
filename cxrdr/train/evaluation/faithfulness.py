"""Is the mask faithful? Deletion/insertion curves, sparsity, spatial entropy, cross-view consistency.

Deletion: starting from the full image, patches are replaced by a baseline in decreasing mask
order and the cosine similarity of the image embedding to the study's own report embedding is
recorded; a faithful mask makes it fall fast (low AUC). Insertion: starting from the baseline,
patches are put back in the same order; it should rise fast (high AUC). AUCs use the
trapezoid rule over the removed/inserted fraction in [0, 1].

Cross-view consistency: two stored augmentations of one image each select their top-k
patches; the selected patch centres are mapped back into stored-image pixels through each
view's crop params and binned on a common grid over the stored image; the Jaccard of the two
cell sets is taken over the cells both views can see (a crop cannot select what it lacks).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from cxrdr.common.augment import image_to_view, view_to_image
from cxrdr.train.evaluation.localisation import patch_centres_uv


def curve_auc(values, fractions) -> float:
    """Area under a curve sampled at ``fractions`` in [0, 1] (trapezoid rule)."""
    v, f = np.asarray(values, dtype=np.float64), np.asarray(fractions, dtype=np.float64)
    return float(np.sum((v[1:] + v[:-1]) / 2 * np.diff(f)))


def patch_keep_masks(order, grid_size, image_hw, counts) -> torch.Tensor:
    """(len(counts), 1, H, W) float masks: 1 where one of the first ``c`` patches in ``order`` lies."""
    gh, gw = grid_size
    h, w = image_hw
    rank = np.empty(gh * gw, dtype=np.int64)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
    rank_grid = torch.from_numpy(rank.reshape(gh, gw)).float()
    # nearest upsampling of the rank grid to pixels (patch cells may be non-integral)
    rank_px = torch.nn.functional.interpolate(rank_grid[None, None], size=(h, w), mode="nearest")[0, 0]
    return torch.stack([(rank_px < c).float() for c in counts])[:, None]


def deletion_insertion(score_fn, image: torch.Tensor, order, grid_size, steps: int = 10,
                       baseline: str | float = "mean") -> dict:
    """Deletion and insertion curves for one image (1, H, W).

    ``score_fn(images (B, 1, H, W)) -> (B,)`` similarity to the own report; ``order`` lists patch
    indices (row-major in ``grid_size``) from most to least important; ``baseline`` is 'mean'
    (the image's mean grey), 'zero', or a number.
    """
    n = grid_size[0] * grid_size[1]
    if sorted(np.asarray(order).tolist()) != list(range(n)):
        raise ValueError(f"order must be a permutation of the {n} patch indices")
    fractions = np.linspace(0.0, 1.0, steps + 1)
    counts = [int(round(f * n)) for f in fractions]
    masks = patch_keep_masks(order, grid_size, image.shape[-2:], counts)
    base_value = float(image.mean()) if baseline == "mean" else 0.0 if baseline == "zero" \
        else float(baseline)
    base = torch.full_like(image, base_value)
    inserted = masks * image + (1 - masks) * base  # first c patches present
    deleted = (1 - masks) * image + masks * base  # first c patches removed
    with torch.no_grad():
        scores = np.asarray(score_fn(torch.cat([deleted, inserted])), dtype=np.float64).ravel()
    dele, ins = scores[:len(counts)], scores[len(counts):]
    return {"fractions": fractions.tolist(), "deletion": dele.tolist(), "insertion": ins.tolist(),
            "deletion_auc": curve_auc(dele, fractions), "insertion_auc": curve_auc(ins, fractions)}


def sparsity(z, threshold: float = 0.5) -> float:
    """Fraction of patches with z > threshold."""
    return float((np.asarray(z, dtype=np.float64) > threshold).mean())


def spatial_entropy(heatmap) -> float:
    """Entropy of the heatmap as a distribution over patches, normalised to [0, 1] by log N.

    1 = spread evenly, 0 = all mass on one patch. Negative values are clipped to 0.
    """
    h = np.clip(np.nan_to_num(np.asarray(heatmap, dtype=np.float64).ravel()), 0, None)
    if h.size < 2 or h.sum() <= 0:
        return float("nan")
    p = h / h.sum()
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum() / math.log(h.size))


def _cells_of(xy, image_wh, cells) -> set:
    w, h = image_wh
    ch, cw = cells
    out = set()
    for x, y in np.asarray(xy).reshape(-1, 2):
        if 0 <= x < w and 0 <= y < h:
            out.add((min(ch - 1, int(y / h * ch)), min(cw - 1, int(x / w * cw))))
    return out


def visible_cells(params: dict, image_wh, cells) -> set:
    """Cells of the stored-image grid whose centre lies inside the view."""
    w, h = image_wh
    ch, cw = cells
    yy, xx = np.meshgrid((np.arange(ch) + 0.5) / ch * h, (np.arange(cw) + 0.5) / cw * w, indexing="ij")
    uv = image_to_view(params, np.stack([xx.ravel(), yy.ravel()], axis=1))
    ok = (np.abs(uv) <= 1).all(axis=1).reshape(ch, cw)
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(ok))}


def topk_image_cells(scores, params: dict, image_wh, k: int, cells) -> set:
    """Stored-image cells hit by the centres of the view's top-k patches (scores (gh, gw))."""
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf)
    top = np.argsort(-s.ravel(), kind="stable")[:k]
    uv = patch_centres_uv(s.shape)[top]
    return _cells_of(view_to_image(params, uv), image_wh, cells)


def jaccard(a: set, b: set) -> float:
    union = a | b
    return len(a & b) / len(union) if union else float("nan")


def cross_view_jaccard(scores_a, params_a: dict, scores_b, params_b: dict, image_wh,
                       k: int, cells=None) -> float:
    """Jaccard of two views' top-k patch sets in stored-image cells, over commonly visible cells."""
    cells = tuple(cells or np.asarray(scores_a).shape)
    common = visible_cells(params_a, image_wh, cells) & visible_cells(params_b, image_wh, cells)
    a = topk_image_cells(scores_a, params_a, image_wh, k, cells) & common
    b = topk_image_cells(scores_b, params_b, image_wh, k, cells) & common
    return jaccard(a, b)
