"""Localisation against ground-truth boxes: pointing game and IoU/Dice of the top-20% heatmap.

Heatmaps live on the student's patch grid (gh, gw) of the *view* the model saw. Boxes are in
stored-image pixels, so a patch belongs to a box when its centre, mapped back into the stored
image through the view's augmentation params (``cxrdr.common.augment.view_to_image``), falls
inside the box; that is exact for crops and rotations alike. A box that holds no patch centre
(thinner than a patch) gets the patches it overlaps, so thin and tiny findings are still scorable.

Two heatmaps: the Patch-IB mask z (ranked by the soft scores z is made from, which orders
patches identically but without the ties of a hard top-k), and the local-alignment attention of
a finding's words in the report (``local_attn`` rows of the tokens spelling the box label,
averaged).

Targets follow the standard pointing game (a hit when the map's maximum falls inside any
ground-truth box of the target): for the attention of a finding's words the target is the union
of that label's boxes (a bilateral finding has one box per lung); for the class-agnostic mask z
it is the union of all the image's boxes. Every score comes with the chance level of a uniformly
random heatmap on the same grid and target (``chance_scores``).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from cxrdr.common.augment import image_to_view, view_to_image


def patch_centres_uv(grid_size) -> np.ndarray:
    """(gh*gw, 2) view coordinates (u=x, v=y in [-1, 1]) of patch centres, row-major."""
    gh, gw = grid_size
    v = (np.arange(gh) + 0.5) / gh * 2 - 1
    u = (np.arange(gw) + 0.5) / gw * 2 - 1
    vv, uu = np.meshgrid(v, u, indexing="ij")
    return np.stack([uu.ravel(), vv.ravel()], axis=1)


def box_patch_mask(box, params: dict, grid_size, samples: int = 4) -> np.ndarray:
    """Bool (gh, gw): patches of the view whose centre lies inside ``box`` [x0, y0, x1, y1].

    A box that holds no patch centre (thinner than a patch: a line of plate atelectasis, a small
    nodule) gets every patch it overlaps instead, tested on a ``samples`` x ``samples`` grid of points
    per patch mapped through the view's augmentation: at patch resolution a map cannot point more
    finely than that, and one patch holding the box centre would make a thin box a coin toss between
    the patches it crosses.
    """
    gh, gw = grid_size
    x0, y0, x1, y1 = (float(b) for b in box)

    def inside(xy):
        return (xy[:, 0] >= x0) & (xy[:, 0] <= x1) & (xy[:, 1] >= y0) & (xy[:, 1] <= y1)

    mask = inside(view_to_image(params, patch_centres_uv(grid_size))).reshape(gh, gw)
    if not mask.any():
        offsets = ((np.arange(samples) + 0.5) / samples - 0.5) * 2  # within one patch, in patch units
        du, dv = np.meshgrid(offsets / gw, offsets / gh)
        centres = patch_centres_uv(grid_size)  # (N, 2)
        points = centres[:, None, :] + np.stack([du.ravel(), dv.ravel()], axis=1)[None]  # (N, S, 2)
        hits = inside(view_to_image(params, points.reshape(-1, 2))).reshape(len(centres), -1)
        mask = hits.any(1).reshape(gh, gw)
    return mask


def scatter_to_grid(values, patch_index, grid_size, fill: float = float("nan")) -> np.ndarray:
    """Values for the kept patches (N,) -> (gh, gw) map; dropped patches get ``fill``."""
    gh, gw = grid_size
    grid = np.full(gh * gw, fill, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64).ravel()
    index = np.arange(len(values)) if patch_index is None else np.asarray(patch_index).ravel()
    grid[index] = values
    return grid.reshape(gh, gw)


def pointing_hit(heatmap, gt_mask) -> bool:
    """Pointing game: is the heatmap's maximum (first one on ties; NaN ignored) inside the box?"""
    h = np.asarray(heatmap, dtype=np.float64)
    if not np.isfinite(h).any():
        return False
    return bool(np.asarray(gt_mask).ravel()[int(np.nanargmax(h.ravel()))])


def top_fraction_mask(heatmap, fraction: float = 0.2) -> np.ndarray:
    """Bool mask of the top ``ceil(fraction * cells)`` cells (NaN cells rank last)."""
    h = np.nan_to_num(np.asarray(heatmap, dtype=np.float64), nan=-np.inf)
    k = max(1, math.ceil(fraction * h.size))
    order = np.argsort(-h.ravel(), kind="stable")[:k]
    mask = np.zeros(h.size, dtype=bool)
    mask[order] = True
    return mask.reshape(h.shape)


def iou_dice(pred, gt) -> tuple[float, float]:
    pred, gt = np.asarray(pred, bool), np.asarray(gt, bool)
    inter, union = float((pred & gt).sum()), float((pred | gt).sum())
    total = float(pred.sum() + gt.sum())
    return (inter / union if union else 0.0), (2 * inter / total if total else 0.0)


def chance_scores(gt_mask, top_fraction: float = 0.2) -> dict:
    """Expected pointing hit, IoU and Dice of a uniformly random heatmap on the same grid and target.

    A random map's maximum is a uniform cell, so P(hit) = |target| / cells. Its top-k cells are a
    uniform k-subset, so the overlap I with the G target cells is hypergeometric; IoU = I/(k+G-I)
    and Dice = 2I/(k+G) are averaged over that exact distribution (no sampling noise).
    """
    gt = np.asarray(gt_mask, bool)
    cells = gt.size
    return dict(_chance_by_counts(cells, int(gt.sum()), max(1, math.ceil(top_fraction * cells))))


@functools.lru_cache(maxsize=4096)
def _chance_by_counts(cells: int, g: int, k: int) -> tuple:
    """``chance_scores`` of a target of ``g`` of ``cells`` cells and a top-``k`` map. It depends on the three counts
    only, which repeat across an evaluation's targets: kept, since scipy's hypergeometric cost ~0.7 ms a call
    (0.7 s of a CPU evaluation's 5.8 s of localisation, benchmarks/evaluation_phases.py)."""
    from scipy.stats import hypergeom

    overlap = np.arange(0, min(k, g) + 1)
    p = hypergeom.pmf(overlap, cells, g, k)
    union = k + g - overlap
    return (("hit", g / cells), ("iou", float((p * overlap / np.maximum(union, 1)).sum())),
            ("dice", float((p * 2 * overlap / (k + g)).sum()) if k + g else 0.0))


def localisation_scores(heatmap, gt_mask, top_fraction: float = 0.2) -> dict:
    """Pointing hit, IoU and Dice of the top-``top_fraction`` cells, and the same for a random map."""
    iou, dice = iou_dice(top_fraction_mask(heatmap, top_fraction), gt_mask)
    chance = chance_scores(gt_mask, top_fraction)
    return {"hit": pointing_hit(heatmap, gt_mask), "iou": iou, "dice": dice,
            "chance_hit": chance["hit"], "chance_iou": chance["iou"], "chance_dice": chance["dice"]}


def aggregate(scores: list[dict]) -> dict:
    """Mean pointing-game accuracy, IoU and Dice over targets, beside those of a random heatmap."""
    keys = {"pointing_game": "hit", "iou": "iou", "dice": "dice", "chance_pointing_game": "chance_hit",
            "chance_iou": "chance_iou", "chance_dice": "chance_dice"}
    out = {name: (float(np.mean([s[key] for s in scores])) if scores else float("nan"))
           for name, key in keys.items()}
    out["n"] = len(scores)
    out["n_boxes"] = int(sum(s.get("n_boxes", 1) for s in scores))
    return out


def prior_hits(maps: list, targets: list) -> list[bool]:
    """Per target, the pointing hit of the input-independent guess of ``prior_pointing_game`` (the mean
    of the OTHER images' maps, NaN cells ignored); empty with fewer than two maps (no other image)."""
    if len(maps) < 2:
        return []
    stack = np.stack([np.asarray(m, dtype=np.float64) for m in maps])
    finite = np.isfinite(stack)
    filled = np.where(finite, stack, 0.0)
    total, count = filled.sum(0), finite.sum(0)
    hits = []
    for i, gt in enumerate(targets):
        others = count - finite[i]
        mean = np.where(others > 0, (total - filled[i]) / np.maximum(others, 1), np.nan)
        hits.append(pointing_hit(mean, gt))
    return hits


def prior_pointing_game(maps: list, targets: list) -> float:
    """Pointing game of an input-independent guess: for target i, the mean of the OTHER images'
    maps (leave-one-out, NaN cells ignored). A model whose maps are the same for every image scores
    about this, however far above a random heatmap it is: localisation must beat it."""
    hits = prior_hits(maps, targets)
    return float(np.mean(hits)) if hits else float("nan")


def map_similarity(maps: list) -> float:
    """Mean pairwise correlation of heatmaps (each centred on its mean, NaN cells as that mean). Near 1:
    the maps are the same whatever the image or word (a collapsed, input-independent map); NaN with
    fewer than two maps. Centred because a plain cosine of maps with a common offset (the mask's
    sigmoid scores sit near 0.5 everywhere) is near 1 even when their peaks differ."""
    flat = [np.asarray(m, dtype=np.float64).ravel() for m in maps]
    flat = [np.nan_to_num(f - np.nanmean(f)) for f in flat if np.isfinite(f).any()]
    flat = [f / n for f in flat if (n := np.linalg.norm(f)) > 0]
    if len(flat) < 2:
        return float("nan")
    x = np.stack(flat)
    sim = x @ x.T
    return float(sim[~np.eye(len(x), dtype=bool)].mean())


def normalised_entropy(heatmap) -> float:
    """Entropy of a non-negative map (as a distribution over its finite cells) / log(cells): 1 = uniform."""
    h = np.asarray(heatmap, dtype=np.float64).ravel()
    h = np.clip(h[np.isfinite(h)], 0, None)
    if h.size < 2 or h.sum() <= 0:
        return float("nan")
    p = h / h.sum()
    return float(-(p[p > 0] * np.log(p[p > 0])).sum() / np.log(h.size))


def label_phrases(label: str) -> list[str]:
    """Phrases to look for in the report for a box label, most specific first.

    'pleural_effusion' -> ['pleural effusion', 'effusion', 'pleural'].
    """
    phrase = label.replace("_", " ").strip().lower()
    words = sorted({w for w in phrase.split() if len(w) > 3}, key=lambda w: (-len(w), w))
    return [phrase] + [w for w in words if w != phrase]


def find_subsequence(seq, sub) -> list[int]:
    """Start positions of ``sub`` as a contiguous run in ``seq``."""
    n, m = len(seq), len(sub)
    return [i for i in range(n - m + 1) if m and list(seq[i:i + m]) == list(sub)]


def phrase_positions(report_ids, phrase_ids_list) -> list[int]:
    """Token positions of the first phrase (in order) that occurs in the report token ids."""
    for ids in phrase_ids_list:
        starts = find_subsequence(list(report_ids), list(ids))
        if starts:
            return sorted({s + j for s in starts for j in range(len(ids))})
    return []


def attention_heatmap(local_attn, positions) -> np.ndarray | None:
    """Mean of the attention rows (L, N) at ``positions`` -> (N,), or None when no position."""
    if not positions:
        return None
    return np.asarray(local_attn, dtype=np.float64)[positions].mean(axis=0)
