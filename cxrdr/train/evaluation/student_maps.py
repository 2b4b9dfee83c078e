"""Localisation and mask faithfulness of a student: one forward per chosen image, its heatmaps
scored against the boxes (pointing game, IoU, Dice) and by deletion/insertion curves.

Rows: the first ``n_localisation`` images of the split with boxes and the first
``n_faithfulness`` images; each is run once and scored for whichever it belongs to.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from tqdm.auto import tqdm

from cxrdr.common import augment
from cxrdr.common.shards import Sample
from cxrdr.train.evaluation import bootstrap, box_prior
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
    """One image's forward and what every score needs from it: row ``row`` of its batch's ``out``."""

    sample: Sample
    text: str
    view: torch.Tensor
    params: dict
    out: object
    row: int
    ids: list
    grid: tuple
    z_heat: np.ndarray | None


def localisation_and_faithfulness(model: EvalModel, samples: list[Sample], texts: list[str],
                                  n_localisation: int, n_faithfulness: int, steps: int,
                                  top_fraction: float, n_plots: int, seed: int,
                                  progress: bool, train_boxes: list | None = None,
                                  batch_size: int = 32) -> tuple[dict, dict, dict]:
    """Returns (localisation results, faithfulness results, plot material). ``train_boxes``: the train
    split's ``(width, height, boxes)`` per image, for the train-box prior baselines (``box_prior``);
    ``batch_size``: images a forward (the scores are per image, whatever the batch)."""
    phrase_ids = PhraseTokens(model.module)
    with_boxes = [i for i in range(len(samples)) if samples[i].meta.get("boxes")][:n_localisation]
    faith_rows = list(range(len(samples)))[:n_faithfulness]
    tally = _Tally()
    rng = np.random.default_rng(seed)
    rows = sorted(set(with_boxes) | set(faith_rows))
    for i, f in tqdm(zip(rows, _forwards(model, samples, texts, rows, batch_size)), total=len(rows),
                     desc="localisation/faithfulness", disable=not progress, leave=False):
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


def _forwards(model: EvalModel, samples: list[Sample], texts: list[str], rows: list[int],
              batch_size: int) -> Iterator[_Forward]:
    """The forwards of ``rows``, ``batch_size`` images a call, in order. One call an image left a GPU waiting on
    the host's Python (~8 s of an H200's evaluation for 200 images); a student's eval forward reads each image
    and text alone, so a row's maps are the same computation either way (float rounding aside)."""
    step = max(1, batch_size)
    for start in range(0, len(rows), step):
        chunk = rows[start:start + step]
        views, params = zip(*(full_view(samples[i], model.image_size) for i in chunk))
        out, tok = model.forward(torch.stack(views), [texts[i] for i in chunk])
        out = _maps_on_host(out)
        for row, i in enumerate(chunk):
            ids = tok["input_ids"][row][tok["attention_mask"][row].bool()].tolist()
            yield _Forward(samples[i], texts[i], views[row], params[row], out, row, ids, grid_of(out),
                           mask_heat(out, row))


def _maps_on_host(out) -> SimpleNamespace:
    """What the maps read of a batch's output (``maps``), copied to the host once for the batch, in float32."""
    def host(name):
        value = getattr(out, name, None)
        return None if value is None else value.detach().float().cpu() if value.is_floating_point() \
            else value.detach().cpu()

    return SimpleNamespace(grid_size=out.grid_size, **{name: host(name) for name in (
        "mask", "mask_scores", "local_attn", "patch_index", "head_index")})


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
        # every score keeps its image's key: the bootstrap resamples images, not targets
        key = f.sample.key
        tally.mask_scores.append({**loc.localisation_scores(f.z_heat, everything, top_fraction),
                                  "n_boxes": sum(len(m) for m in targets.values()), "key": key})
        tally.z_maps.append(f.z_heat)
        tally.z_targets.append(everything)
        pathology = [g for label, masks in targets.items() if box_prior.is_pathology(label) for g in masks]
        if pathology:
            tally.pathology_scores.append({**loc.localisation_scores(f.z_heat, np.any(pathology, axis=0),
                                                                     top_fraction), "n_boxes": len(pathology),
                                           "key": key})
            tally.pathology_targets.append(np.any(pathology, axis=0))
        for label, masks in targets.items():  # per label: is z's peak on this finding?
            tally.label(label)["mask"].append(
                {**loc.localisation_scores(f.z_heat, np.any(masks, axis=0), top_fraction), "n_boxes": len(masks),
                 "key": key, "label": label})
    for label, masks in targets.items():
        positions = loc.phrase_positions(f.ids, [phrase_ids(p) for p in loc.label_phrases(label)])
        heat = attn_heat(f.out, f.row, positions)
        if heat is None:
            if getattr(f.out, "local_attn", None) is not None:
                tally.no_tokens.append(f"{f.sample.key}:{label}")
            continue
        sc = {**loc.localisation_scores(heat, np.any(masks, axis=0), top_fraction), "n_boxes": len(masks),
              "key": f.sample.key, "label": label}
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
        order_heat, source = attn_heat(f.out, f.row, list(range(len(f.ids)))), "attention"
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
    z_full = mask_z(f.out, f.row)
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
    out, _ = model.forward(torch.stack([augment.replay(image, p, model.image_size) for p in views]),
                           [f.text] * len(views))
    out = _maps_on_host(out)
    heats = [mask_heat(out, row) for row in range(len(views))]
    k = max(1, math.ceil(top_fraction * f.grid[0] * f.grid[1]))
    return faith.cross_view_jaccard(heats[0], views[0], heats[1], views[1], image.size, k, f.grid)


def _localisation_results(tally: _Tally, n_images: int, top_fraction: float, train_boxes: list | None) -> dict:
    per_label = {lab: {k: loc.aggregate(v) for k, v in d.items()} for lab, d in sorted(tally.per_label.items())}
    hits = _hits(tally)
    out = {
        "mask": {**loc.aggregate(tally.mask_scores), "image_similarity": loc.map_similarity(tally.z_maps),
                 "entropy": _nanmean([loc.normalised_entropy(m) for m in tally.z_maps]),
                 "prior_pointing_game": _mean_of(hits["mask"]["loo_prior"]),
                 "pathology": loc.aggregate(tally.pathology_scores)},
        "attention": {**loc.aggregate(tally.attn_scores),
                      "prior_pointing_game": _mean_of(hits["attention"]["loo_prior"]),
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
        _add_train_priors(out, tally, hits, box_prior.box_frequency_maps(train_boxes, tally.grid))
    _add_intervals(out, hits)
    out["hits"] = hits
    return out


# per-target hit list in ``hits`` -> the figure it averages to, in a heatmap's block of eval.json
HIT_FIGURES = {"model": "pointing_game", "chance": "chance_pointing_game", "loo_prior": "prior_pointing_game",
               "train_prior": "train_prior_pointing_game"}


def _hits(tally: _Tally) -> dict:
    """Per target, in evaluation order: its image's key, the model's hit (0/1), a random map's hit
    probability and the leave-one-out prior's hit (None where a finding was seen once: no other image)."""
    def block(scores, with_label=False):
        out = {"keys": [s["key"] for s in scores]}
        if with_label:
            out["labels"] = [s["label"] for s in scores]
        out["model"] = [int(s["hit"]) for s in scores]
        out["chance"] = [float(s["chance_hit"]) for s in scores]
        return out

    mask = {**block(tally.mask_scores),
            "loo_prior": [int(h) for h in loc.prior_hits(tally.z_maps, tally.z_targets)] or
            [None] * len(tally.mask_scores)}
    attention = {**block(tally.attn_scores, with_label=True), "loo_prior": _attention_prior_hits(tally)}
    mask_per_label = block([s for d in tally.per_label.values() for s in d["mask"]], with_label=True)
    return {"unit": "one entry per pointing-game target in evaluation order; keys: the image of each target "
                    "(intervals resample images, keeping an image's targets together); model, loo_prior, "
                    "train_prior: hits 0/1 (None: no value for that target); chance: a random map's hit "
                    "probability",
            "mask": mask, "mask_pathology": block(tally.pathology_scores), "attention": attention,
            "mask_per_label": mask_per_label}


def _attention_prior_hits(tally: _Tally) -> list:
    """The attention's leave-one-out prior per target: each label's own mean map of its other images;
    None for a label seen in one image only (no other image to average)."""
    per_label = {label: iter(loc.prior_hits(maps, tally.attn_targets[label]))
                 for label, maps in tally.attn_maps.items() if len(maps) >= 2}
    return [int(next(per_label[s["label"]])) if s["label"] in per_label else None for s in tally.attn_scores]


def _add_train_priors(out: dict, tally: _Tally, hits: dict, maps: dict) -> None:
    """The train-box prior's pointing game beside every model score it baselines (``box_prior``), and its
    per-target hits in ``hits``."""
    def hit_list(heatmap, targets):
        return [int(h) for h in box_prior.fixed_map_hits(heatmap, targets)]

    hits["mask"]["train_prior"] = hit_list(maps["any"], tally.z_targets)
    hits["mask_pathology"]["train_prior"] = hit_list(maps["pathology"], tally.pathology_targets)
    # a label without train boxes falls back to the class-agnostic map (``label_prior_pointing_game``)
    label_maps = {label: maps["labels"].get(label, maps["any"]) for label in tally.attn_targets}
    positions = {label: iter(targets) for label, targets in tally.attn_targets.items()}
    hits["attention"]["train_prior"] = [int(loc.pointing_hit(label_maps[lab], next(positions[lab])))
                                        for lab in hits["attention"]["labels"]]
    out["mask"]["train_prior_pointing_game"] = _mean_of(hits["mask"]["train_prior"])
    out["mask"]["pathology"]["train_prior_pointing_game"] = _mean_of(hits["mask_pathology"]["train_prior"])
    out["attention"]["train_prior_pointing_game"] = _mean_of(hits["attention"]["train_prior"])
    for label, scores in out["per_label"].items():
        if "attention" in scores and tally.attn_targets.get(label):
            scores["attention"]["train_prior_pointing_game"] = _mean_of(
                [h for h, lab in zip(hits["attention"]["train_prior"], hits["attention"]["labels"]) if lab == label])
    out["train_prior"] = {"n_images": maps["n_images"], "n_images_per_label": maps["n_images_per_label"],
                          "what": "fixed map: how often each patch lies in a train-split box (class-agnostic "
                                  "for z, that label's boxes for the attention); its single peak is scored"}


def hit_intervals(block: dict, **bootstrap_options) -> dict:
    """From one heatmap's per-target hits (a block of ``hits``): every figure's interval over images
    (``<figure>_interval``: [lo, hi]) and, where the train-box prior was scored, the paired margin model −
    train prior (``margin_over_train_prior``) with its interval (the same resampled images for both)."""
    out = {}
    for name, figure in HIT_FIGURES.items():
        if name in block and block[name]:
            out[f"{figure}_interval"] = bootstrap.bootstrap_rate(block["keys"], block[name],
                                                                 **bootstrap_options)["interval"]
    if block.get("train_prior"):
        m = bootstrap.paired_margin(block["keys"], block["model"], block["train_prior"], **bootstrap_options)
        out["margin_over_train_prior"], out["margin_over_train_prior_interval"] = m["margin"], m["interval"]
    return out


def _select(block: dict, label: str) -> dict:
    """The targets of one label in a block with ``labels``."""
    keep = [i for i, lab in enumerate(block["labels"]) if lab == label]
    return {k: [v[i] for i in keep] for k, v in block.items() if isinstance(v, list)}


def _add_intervals(out: dict, hits: dict) -> None:
    """Intervals over images beside every pointing game: overall, z on pathology boxes, per label."""
    out["mask"].update(hit_intervals(hits["mask"]))
    out["mask"]["pathology"].update(hit_intervals(hits["mask_pathology"]))
    out["attention"].update(hit_intervals(hits["attention"]))
    for label, scores in out["per_label"].items():
        for heat, block in (("mask", hits["mask_per_label"]), ("attention", hits["attention"])):
            if scores.get(heat, {}).get("n"):
                chosen = _select(block, label)
                if "loo_prior" in chosen:  # the leave-one-out prior per label, beside its interval
                    scores[heat]["prior_pointing_game"] = _mean_of(chosen["loo_prior"])
                scores[heat].update(hit_intervals(chosen))
    out["bootstrap"] = {"unit": "image", "n_boot": bootstrap.N_BOOT, "seed": bootstrap.SEED,
                        "confidence": bootstrap.CONFIDENCE, "method": "percentile",
                        "what": "every [lo, hi] resamples the evaluation images with replacement (an image's "
                                "targets stay together: they are correlated); a margin resamples model and "
                                "baseline on the same images"}


def _mean_of(values) -> float:
    """Mean of the per-target values that exist (None: no value), NaN when none does."""
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else float("nan")


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
