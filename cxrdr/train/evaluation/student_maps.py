"""Localisation and mask faithfulness of a student: one forward per chosen image, its heatmaps
scored against the boxes (pointing game, IoU, Dice) and by deletion/insertion curves.

Rows: the first ``n_localisation`` images of the split with boxes and the first
``n_faithfulness`` images; each is run once and scored for whichever it belongs to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from cxrdr.common import augment
from cxrdr.common.shards import Sample
from cxrdr.train.evaluation import box_prior
from cxrdr.train.evaluation import faithfulness as faith
from cxrdr.train.evaluation import localisation as loc
from cxrdr.train.evaluation.embedding import EvalModel, embed_texts, full_view
from cxrdr.train.evaluation.maps import PhraseTokens, attn_heat, grid_of, mask_heat, mask_z


@dataclass
class _Tally:
    """What the pass collects over the images."""

    mask_scores: list = field(default_factory=list)
    pathology_scores: list = field(default_factory=list)  # z against pathology boxes only (no devices)
    pathology_targets: list = field(default_factory=list)
    grid: tuple | None = None
    attn_scores: list = field(default_factory=list)
    per_label: dict = field(default_factory=dict)
    no_tokens: list = field(default_factory=list)
    z_maps: list = field(default_factory=list)  # collapse diagnostics: z maps, attention maps per label
    z_targets: list = field(default_factory=list)  # ... and their targets (the prior-map baseline)
    attn_maps: dict = field(default_factory=dict)
    attn_targets: dict = field(default_factory=dict)
    entropies_attn: list = field(default_factory=list)
    word_similarity: list = field(default_factory=list)
    curves: list = field(default_factory=list)
    random_curves: list = field(default_factory=list)
    sparsities: list = field(default_factory=list)
    entropies: list = field(default_factory=list)
    jaccards: list = field(default_factory=list)
    order_sources: set = field(default_factory=set)
    plots: list = field(default_factory=list)

    def label(self, label: str) -> dict:
        return self.per_label.setdefault(label, {"mask": [], "attention": []})


@dataclass
class _Forward:
    """One image's forward and what every score needs from it."""

    sample: Sample
    text: str
    view: torch.Tensor
    params: dict
    out: object
    ids: list
    grid: tuple
    z_heat: np.ndarray | None


def localisation_and_faithfulness(model: EvalModel, samples: list[Sample], texts: list[str],
                                  n_localisation: int, n_faithfulness: int, steps: int,
                                  top_fraction: float, n_plots: int, seed: int,
                                  progress: bool, train_boxes: list | None = None) -> tuple[dict, dict, dict]:
    """Returns (localisation results, faithfulness results, plot material). ``train_boxes``: the train
    split's ``(width, height, boxes)`` per image, for the train-box prior baselines (``box_prior``)."""
    phrase_ids = PhraseTokens(model.module)
    with_boxes = [i for i in range(len(samples)) if samples[i].meta.get("boxes")][:n_localisation]
    faith_rows = list(range(len(samples)))[:n_faithfulness]
    tally = _Tally()
    rng = np.random.default_rng(seed)
    for i in tqdm(sorted(set(with_boxes) | set(faith_rows)), desc="localisation/faithfulness",
                  disable=not progress, leave=False):
        f = _forward(model, samples[i], texts[i])
        tally.grid = f.grid
        # the plot shows z's soft scores, the map its pointing game scores (the hard Top-K of the same
        # order keeps a fixed share of patches and looks alike across images whatever it ranks first)
        item = {"key": f.sample.key, "image": f.view[0].numpy(), "z": f.z_heat, "boxes": [], "attn": []}
        if i in with_boxes:
            _score_localisation(tally, f, item, phrase_ids, model.image_size, top_fraction)
        if i in faith_rows:
            _score_faithfulness(tally, model, f, steps, top_fraction, rng)
        if item["boxes"] or item["z"] is not None:
            tally.plots.append(item)
    ids_used = {"localisation": [samples[i].key for i in with_boxes],
                "faithfulness": [samples[i].key for i in faith_rows]}
    return (_localisation_results(tally, len(with_boxes), top_fraction, train_boxes),
            _faithfulness_results(tally, steps),
            {"heatmaps": varied_plots(tally.plots, n_plots), "ids": ids_used})


def _forward(model: EvalModel, sample: Sample, text: str) -> _Forward:
    view, params = full_view(sample, model.image_size)
    out, tok = model.forward(view[None], [text])
    ids = tok["input_ids"][0][tok["attention_mask"][0].bool()].tolist()
    return _Forward(sample, text, view, params, out, ids, grid_of(out), mask_heat(out, 0))


def _box_targets(f: _Forward, item: dict, size: int) -> dict[str, list]:
    """label -> patch masks of its boxes (one per lung if bilateral); the boxes go to the plot item."""
    w, h = f.sample.meta.get("image_size") or f.sample.image().size
    targets: dict[str, list] = {}
    for box in f.sample.meta["boxes"]:
        label = str(box.get("label") or "finding")  # schema 3 stores a box without a label with label ""
        item["boxes"].append((label, _box_in_view(box["box"], w, h, size)))
        gt = loc.box_patch_mask(box["box"], f.params, f.grid)
        if gt.any():
            targets.setdefault(label, []).append(gt)
    return targets


def _score_localisation(tally: _Tally, f: _Forward, item: dict, phrase_ids: PhraseTokens, size: int,
                        top_fraction: float) -> None:
    targets = _box_targets(f, item, size)
    if targets and f.z_heat is not None:  # class-agnostic z: any box of the image is a hit
        everything = np.any([g for masks in targets.values() for g in masks], axis=0)
        tally.mask_scores.append({**loc.localisation_scores(f.z_heat, everything, top_fraction),
                                  "n_boxes": sum(len(m) for m in targets.values())})
        tally.z_maps.append(f.z_heat)
        tally.z_targets.append(everything)
        pathology = [g for label, masks in targets.items() if box_prior.is_pathology(label) for g in masks]
        if pathology:
            tally.pathology_scores.append({**loc.localisation_scores(f.z_heat, np.any(pathology, axis=0),
                                                                     top_fraction), "n_boxes": len(pathology)})
            tally.pathology_targets.append(np.any(pathology, axis=0))
        for label, masks in targets.items():  # per label: is z's peak on this finding?
            tally.label(label)["mask"].append(
                {**loc.localisation_scores(f.z_heat, np.any(masks, axis=0), top_fraction), "n_boxes": len(masks)})
    for label, masks in targets.items():
        positions = loc.phrase_positions(f.ids, [phrase_ids(p) for p in loc.label_phrases(label)])
        heat = attn_heat(f.out, 0, positions)
        if heat is None:
            if getattr(f.out, "local_attn", None) is not None:
                tally.no_tokens.append(f"{f.sample.key}:{label}")
            continue
        sc = {**loc.localisation_scores(heat, np.any(masks, axis=0), top_fraction), "n_boxes": len(masks)}
        tally.attn_scores.append(sc)
        tally.label(label)["attention"].append(sc)
        tally.attn_maps.setdefault(label, []).append(heat)
        tally.attn_targets.setdefault(label, []).append(np.any(masks, axis=0))
        tally.entropies_attn.append(loc.normalised_entropy(heat))
        item["attn"].append((label, heat))
    if len(item["attn"]) >= 2:
        tally.word_similarity.append(loc.map_similarity([heat for _, heat in item["attn"]]))


def _score_faithfulness(tally: _Tally, model: EvalModel, f: _Forward, steps: int, top_fraction: float,
                        rng: np.random.Generator) -> None:
    order_heat, source = f.z_heat, "mask"
    if order_heat is None and getattr(f.out, "local_attn", None) is not None:
        order_heat, source = attn_heat(f.out, 0, list(range(len(f.ids)))), "attention"
    if order_heat is None:
        return
    tally.order_sources.add(source)
    order = np.argsort(-np.nan_to_num(order_heat.ravel(), nan=-np.inf), kind="stable")
    own = torch.from_numpy(embed_texts(model, [f.text], 1)[0])

    def score_fn(images):
        return torch.from_numpy(model.embed_images(images)) @ own

    tally.curves.append(faith.deletion_insertion(score_fn, f.view, order, f.grid, steps))
    tally.random_curves.append(faith.deletion_insertion(score_fn, f.view, rng.permutation(order.size),
                                                        f.grid, steps))
    z_full = mask_z(f.out, 0)
    if z_full is not None:
        tally.sparsities.append(faith.sparsity(z_full))
        tally.entropies.append(faith.spatial_entropy(z_full))
    stored = f.sample.meta.get("aug") or []
    if len(stored) >= 2 and f.z_heat is not None:
        j = _cross_view_jaccard(model, f, stored[:2], top_fraction)
        if not math.isnan(j):
            tally.jaccards.append(j)


def _cross_view_jaccard(model: EvalModel, f: _Forward, views: list[dict], top_fraction: float) -> float:
    """Overlap of the top patches of z in two stored views, mapped back to the stored image."""
    image = f.sample.image()
    heats = []
    for p in views:
        out, _ = model.forward(augment.replay(image, p, model.image_size)[None], [f.text])
        heats.append(mask_heat(out, 0))
    k = max(1, math.ceil(top_fraction * f.grid[0] * f.grid[1]))
    return faith.cross_view_jaccard(heats[0], views[0], heats[1], views[1], image.size, k, f.grid)


def _localisation_results(tally: _Tally, n_images: int, top_fraction: float, train_boxes: list | None) -> dict:
    per_label = {lab: {k: loc.aggregate(v) for k, v in d.items()} for lab, d in sorted(tally.per_label.items())}
    out = {
        "mask": {**loc.aggregate(tally.mask_scores), "image_similarity": loc.map_similarity(tally.z_maps),
                 "entropy": _nanmean([loc.normalised_entropy(m) for m in tally.z_maps]),
                 "prior_pointing_game": loc.prior_pointing_game(tally.z_maps, tally.z_targets),
                 "pathology": loc.aggregate(tally.pathology_scores)},
        "attention": {**loc.aggregate(tally.attn_scores),
                      "prior_pointing_game": _attention_prior(tally),
                      "image_similarity": _nanmean([loc.map_similarity(m) for m in tally.attn_maps.values()]),
                      "word_similarity": _nanmean(tally.word_similarity),
                      "entropy": _nanmean(tally.entropies_attn)},
        "targets": "pointing game per target: z - any box of the image (mask.pathology: pathology boxes "
                   "only, no support devices); attention - the boxes of that label",
        "per_label": per_label,
        "n_images": n_images, "top_fraction": top_fraction,
        "boxes_without_finding_tokens": tally.no_tokens,
        "heatmap_z": "soft mask scores (same order as z, no ties)",
    }
    if train_boxes and tally.grid is not None:
        _add_train_priors(out, tally, box_prior.box_frequency_maps(train_boxes, tally.grid))
    return out


def _add_train_priors(out: dict, tally: _Tally, maps: dict) -> None:
    """The train-box prior's pointing game beside every model score it baselines (``box_prior``)."""
    out["mask"]["train_prior_pointing_game"] = box_prior.fixed_map_pointing_game(maps["any"], tally.z_targets)
    out["mask"]["pathology"]["train_prior_pointing_game"] = box_prior.fixed_map_pointing_game(
        maps["pathology"], tally.pathology_targets)
    out["attention"]["train_prior_pointing_game"] = box_prior.label_prior_pointing_game(
        maps["labels"], maps["any"], tally.attn_targets)
    for label, scores in out["per_label"].items():
        targets = tally.attn_targets.get(label, [])
        own = maps["labels"].get(label, maps["any"])
        if "attention" in scores and targets:
            scores["attention"]["train_prior_pointing_game"] = box_prior.fixed_map_pointing_game(own, targets)
    out["train_prior"] = {"n_images": maps["n_images"], "n_images_per_label": maps["n_images_per_label"],
                          "what": "fixed map: how often each patch lies in a train-split box (class-agnostic "
                                  "for z, that label's boxes for the attention); its single peak is scored"}


def _attention_prior(tally: _Tally) -> float:
    """The prior-map pointing game of the attention, per label (each label's own mean map), pooled."""
    hits, n = 0.0, 0
    for label, maps in tally.attn_maps.items():
        if len(maps) >= 2:
            hits += loc.prior_pointing_game(maps, tally.attn_targets[label]) * len(maps)
            n += len(maps)
    return hits / n if n else float("nan")


def _faithfulness_results(tally: _Tally, steps: int) -> dict:
    curves, random_curves = tally.curves, tally.random_curves
    out = {"n_images": len(curves), "order_source": sorted(tally.order_sources), "steps": steps,
           "baseline": "image mean grey"}
    if curves:
        def mean(key, cs):
            return np.mean([c[key] for c in cs], axis=0).tolist()

        out.update({
            "deletion_auc": float(np.mean([c["deletion_auc"] for c in curves])),
            "insertion_auc": float(np.mean([c["insertion_auc"] for c in curves])),
            "random_deletion_auc": float(np.mean([c["deletion_auc"] for c in random_curves])),
            "random_insertion_auc": float(np.mean([c["insertion_auc"] for c in random_curves])),
            "curves": {"fractions": curves[0]["fractions"], "deletion": mean("deletion", curves),
                       "insertion": mean("insertion", curves),
                       "random_deletion": mean("deletion", random_curves),
                       "random_insertion": mean("insertion", random_curves)},
        })
    out["sparsity"] = float(np.mean(tally.sparsities)) if tally.sparsities else None
    out["spatial_entropy"] = float(np.nanmean(tally.entropies)) if tally.entropies else None
    out["cross_view_jaccard"] = float(np.mean(tally.jaccards)) if tally.jaccards else None
    out["cross_view_n"] = len(tally.jaccards)
    return out


def varied_plots(items: list[dict], n: int) -> list[dict]:
    """Up to ``n`` heatmap items, each new one showing a finding not shown yet where possible (the first
    images of a split are often follow-ups of one patient with the same finding), then in order."""
    chosen, shown = [], set()
    for item in items:
        labels = {label for label, _ in item["attn"]} or {label for label, _ in item["boxes"]}
        if len(chosen) < n and labels - shown:
            chosen.append(item)
            shown |= labels
    rest = [item for item in items if all(item is not c for c in chosen)]
    return chosen + rest[:max(0, n - len(chosen))]


def _nanmean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else float("nan")


def _box_in_view(box, w, h, size) -> list[float]:
    """Stored-image box -> pixel box in the full-image view at ``size`` (identity params)."""
    x0, y0, x1, y1 = box
    return [x0 * size / w, y0 * size / h, x1 * size / w, y1 * size / h]
