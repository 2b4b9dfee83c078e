"""The benchmark's localisation pass: one batched forward per image (one text per boxed finding), its maps
scored against the boxes beside chance, the leave-one-out prior and the train split's box-frequency prior."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from cxrdr.common import augment
from cxrdr.common.nih import BOX_FINDINGS, finding_words
from cxrdr.train.evaluation import bootstrap, box_prior
from cxrdr.train.evaluation import localisation as loc
from cxrdr.train.evaluation.benchmark import boxloc
from cxrdr.train.evaluation.benchmark.prompts import grounding_text
from cxrdr.train.evaluation.maps import PhraseTokens, attn_heat, grid_of, mask_heat
from cxrdr.train.evaluation.student_maps import varied_plots

METRICS = ("hit", "iou") + tuple(f"iobb_{t}" for t in boxloc.IOBB_T)
BASELINES = ("model", "chance", "loo_prior", "train_prior")


@dataclass
class Target:
    """One scored target: a heatmap, its target patches and boxes, and the group its priors come from."""

    key: str
    finding: str | None  # None: z against any box of the image
    heat: np.ndarray
    mask: np.ndarray
    boxes: list
    params: dict


def _image_pass(em, row, phrase_ids: PhraseTokens):
    """(view, params, grid, z heat, {finding: attention heat}) of one image."""
    image = row.image()
    params = augment.full_image_params(*image.size)
    view = augment.replay(image, params, em.image_size)
    findings = sorted({b["label"] for b in row.boxes})
    texts = [grounding_text(f) for f in findings] or [grounding_text(BOX_FINDINGS[0])]
    out, tok = em.forward(view[None].expand(len(texts), *view.shape), texts)
    attn = {}
    for i, f in enumerate(findings):
        ids = tok["input_ids"][i][tok["attention_mask"][i].bool()].tolist()
        positions = loc.phrase_positions(ids, [phrase_ids(finding_words(f))])
        heat = attn_heat(out, i, positions)
        if heat is not None:
            attn[f] = heat
    return view, params, grid_of(out), mask_heat(out, 0), attn


def _train_priors(train_rows, grid) -> dict:
    """Class-agnostic (None) and per-finding box-frequency maps of the train split (image-blind; the same
    maps as the shard suite's train prior, ``box_prior.box_frequency_maps``)."""
    maps = box_prior.box_frequency_maps([(*r.size(), r.boxes) for r in train_rows], tuple(grid))
    none = np.full(tuple(grid), np.nan)
    return {None: maps["any"] if maps["n_images"] else none, **{f: maps["labels"].get(f, none) for f in BOX_FINDINGS}}


def _score(targets: list[Target], loo: list, prior_of) -> list[dict]:
    out = []
    for t, loo_map in zip(targets, loo):
        out.append({"finding": t.finding, "key": t.key, "n_boxes": len(t.boxes),
                    "model": boxloc.score_map(t.heat, t.mask, t.boxes, t.params),
                    "chance": boxloc.chance_map_scores(t.mask, t.boxes, t.params),
                    "loo_prior": boxloc.score_map(loo_map, t.mask, t.boxes, t.params),
                    "train_prior": boxloc.score_map(prior_of(t), t.mask, t.boxes, t.params)})
    return out


def aggregate(scored: list[dict]) -> dict:
    """Mean of every metric under every baseline, with the number of targets and boxes; for the pointing
    game, each baseline's interval over images (``hit_interval``) and the paired margin model − train prior
    (``margin_over_train_prior``: ``hit`` and ``hit_interval``, model and prior on the same resampled images;
    ``bootstrap``)."""
    if not scored:
        return {"n": 0, "n_boxes": 0}
    out = {"n": len(scored), "n_boxes": int(sum(s["n_boxes"] for s in scored)),
           **{b: {m: float(np.mean([s[b][m] for s in scored])) for m in METRICS} for b in BASELINES}}
    keys = [s["key"] for s in scored]  # an image's targets (z per finding, several findings) stay together
    for b in BASELINES:
        out[b]["hit_interval"] = bootstrap.bootstrap_rate(keys, [s[b]["hit"] for s in scored])["interval"]
    margin = bootstrap.paired_margin(keys, [s["model"]["hit"] for s in scored],
                                     [s["train_prior"]["hit"] for s in scored])
    out["margin_over_train_prior"] = {"hit": margin["margin"], "hit_interval": margin["interval"]}
    return out


def _by_finding(scored: list[dict], key=lambda s: s["finding"]) -> dict:
    return {f: aggregate([s for s in scored if key(s) == f]) for f in BOX_FINDINGS}


def _attention_similarity(targets: list[Target]) -> float:
    """Mean over findings of the attention maps' correlation across images (1: one map whatever the image)."""
    sims = [loc.map_similarity([t.heat for t in targets if t.finding == f]) for f in BOX_FINDINGS]
    sims = [v for v in sims if np.isfinite(v)]
    return float(np.mean(sims)) if sims else float("nan")


def localise(em, rows, train_rows, n_plots: int = 6, progress: bool = True) -> tuple[dict, list]:
    phrase_ids = PhraseTokens(em.module)
    z_targets, z_per_finding, attn_targets, plots = [], [], [], []
    grid = None
    with torch.no_grad():
        for row in tqdm(rows, desc="localisation", disable=not progress, leave=False):
            if not row.boxes:
                continue
            view, params, grid, z, attn = _image_pass(em, row, phrase_ids)
            size = em.image_size
            w, h = row.size()
            shown = [(b["label"], [b["box"][0] * size / w, b["box"][1] * size / h, b["box"][2] * size / w,
                                   b["box"][3] * size / h]) for b in row.boxes]
            masks = {f: np.any([loc.box_patch_mask(b, params, grid) for b in row.boxes_of(f)], axis=0)
                     for f in sorted({b["label"] for b in row.boxes})}
            if z is not None:
                z_targets.append(Target(row.key, None, z, np.any(list(masks.values()), axis=0), row.boxes_of(),
                                        params))
                z_per_finding += [Target(row.key, f, z, m, row.boxes_of(f), params) for f, m in masks.items()]
            attn_targets += [Target(row.key, f, heat, masks[f], row.boxes_of(f), params) for f, heat in attn.items()]
            plots.append({"key": row.key, "image": view[0].numpy(), "z": z, "boxes": shown,
                          "attn": sorted(attn.items())})
    if grid is None:
        return {"skipped": "no image with boxes"}, []
    priors = _train_priors(train_rows, grid)
    z_loo = dict(zip([t.key for t in z_targets], boxloc.loo_means([t.heat for t in z_targets]))) if z_targets else {}
    z_scored = _score(z_targets, [z_loo[t.key] for t in z_targets], lambda t: priors[None])
    z_f_scored = _score(z_per_finding, [z_loo[t.key] for t in z_per_finding], lambda t: priors[None])
    attn_loo = {}
    for f in BOX_FINDINGS:
        group = [t for t in attn_targets if t.finding == f]
        attn_loo.update({(t.key, f): m for t, m in zip(group, boxloc.loo_means([t.heat for t in group]))}
                        if group else {})
    a_scored = _score(attn_targets, [attn_loo[(t.key, t.finding)] for t in attn_targets],
                      lambda t: priors[t.finding])
    results = {
        "mask": {"overall": aggregate(z_scored), "per_finding": _by_finding(z_f_scored),
                 "image_similarity": loc.map_similarity([t.heat for t in z_targets]),
                 "target": "any box of the image (class-agnostic z)"},
        "attention": {"overall": aggregate(a_scored), "per_finding": _by_finding(a_scored),
                      "image_similarity": _attention_similarity(attn_targets),
                      "target": "the boxes of the finding named in the text", "texts": "prompts.grounding_text"},
        "grid": list(grid), "n_train_images_prior": len(train_rows),
        "baselines": {"chance": "uniformly random heatmap (exact for hit/IoU, 32 seeded draws for T(IoBB))",
                      "loo_prior": "mean map of the other test targets (same finding for attention)",
                      "train_prior": "share of train images whose boxes (of that finding, for attention) cover "
                                     "each patch"},
        "per_target": {"mask": z_scored, "attention": a_scored},
    }
    return results, varied_plots(plots, n_plots)
