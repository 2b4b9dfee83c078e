"""Image-blind localisation baselines from the train split's boxes.

A model that learnt only *where findings usually are* (the heart is central, effusions sit at the bases)
scores far above a random heatmap without looking at the image. The honest baseline is that guess
itself: the frequency with which each patch of the full-image view lies inside a train-split box,
class-agnostic (every box: the baseline of the mask z, which does not know the finding) or per label
(that label's boxes: the baseline of a finding's word attention). Its pointing game is the hit rate of
its one fixed peak on the report set's targets. It reads no report-set box, unlike the leave-one-out
prior of the model's own maps (``localisation.prior_pointing_game``), which it complements.
"""
from __future__ import annotations

import numpy as np

from cxrdr.common.augment import full_image_params
from cxrdr.train.evaluation.localisation import box_patch_mask, pointing_hit

# Box labels that name no pathology: z's pointing game is also reported on pathology boxes alone.
NON_PATHOLOGY_LABELS = frozenset({"support_device", "support devices"})


def is_pathology(label: str) -> bool:
    return str(label).strip().lower() not in NON_PATHOLOGY_LABELS


def box_frequency_maps(box_sets, grid_size) -> dict:
    """Frequency maps on the patch grid from ``box_sets``: iterable of ``(width, height, boxes)`` with
    ``boxes`` a list of ``{"label", "box"}`` in stored-image pixels (one entry per image).

    Returns ``{"any": (gh, gw), "pathology": (gh, gw), "labels": {label: (gh, gw)}, "n_images": int,
    "n_images_per_label": {label: int}}``: the fraction of images (of those holding such a box) whose
    boxes cover each patch, with a patch in a box as the localisation targets define it."""
    gh, gw = grid_size
    total = {"any": np.zeros((gh, gw)), "pathology": np.zeros((gh, gw))}
    counts = {"any": 0, "pathology": 0}
    per_label: dict[str, np.ndarray] = {}
    per_label_n: dict[str, int] = {}
    for width, height, boxes in box_sets:
        if not boxes:
            continue
        params = full_image_params(width, height)
        unions: dict[str, np.ndarray] = {}
        for box in boxes:
            label = str(box.get("label", "finding"))
            mask = box_patch_mask(box["box"], params, grid_size)
            unions[label] = unions.get(label, np.zeros((gh, gw), bool)) | mask
        for label, mask in unions.items():
            per_label[label] = per_label.get(label, np.zeros((gh, gw))) + mask
            per_label_n[label] = per_label_n.get(label, 0) + 1
        total["any"] += np.any(list(unions.values()), axis=0)
        counts["any"] += 1
        pathology = [m for label, m in unions.items() if is_pathology(label)]
        if pathology:
            total["pathology"] += np.any(pathology, axis=0)
            counts["pathology"] += 1
    return {"any": total["any"] / max(counts["any"], 1),
            "pathology": total["pathology"] / max(counts["pathology"], 1),
            "labels": {k: v / per_label_n[k] for k, v in sorted(per_label.items())},
            "n_images": counts["any"], "n_images_per_label": dict(sorted(per_label_n.items()))}


def fixed_map_hits(heatmap, targets) -> list[bool]:
    """Per target, the pointing hit of one fixed map (its single peak, first on ties)."""
    return [pointing_hit(heatmap, t) for t in targets]


def fixed_map_pointing_game(heatmap, targets) -> float:
    """Pointing game of one fixed map against every target (its single peak, first on ties)."""
    if not len(targets):
        return float("nan")
    return float(np.mean(fixed_map_hits(heatmap, targets)))


def label_prior_pointing_game(maps: dict, fallback, targets_by_label: dict) -> float:
    """Per-label fixed maps (``maps[label]``; a label without train boxes gets ``fallback``) against
    each label's targets, pooled over every target."""
    hits, n = 0.0, 0
    for label, targets in targets_by_label.items():
        if not len(targets):
            continue
        hits += fixed_map_pointing_game(maps.get(label, fallback), targets) * len(targets)
        n += len(targets)
    return hits / n if n else float("nan")
