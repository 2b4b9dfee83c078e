"""`train eval --benchmark nih-bbox:PATH/nih_bbox.jsonl`: zero-shot AUC and localisation on real radiographs.

For each of the 8 box findings of NIH ChestX-ray14 (BBox_List_2017) and overall, on one split of the file:
- zero-shot AUC: the finding's prompts (``prompts.finding_prompts``) through the model's own text tower;
  positives are the images labelled (or boxed) with it, negatives the split's other images; image-blind 0.5;
- localisation (students only): the pointing game, top-20 % IoU and T(IoBB) accuracy (``boxloc``) of the
  mask z (class-agnostic: any box of the image) and of the attention of the finding's words in
  ``prompts.grounding_text`` (that finding's boxes), each beside a random map's (chance), the
  leave-one-out mean map of the other test images (prior) and the train split's box frequency (train prior).
Writes ``benchmark.json`` (``summary`` flat), ``benchmark.md`` and ``heatmaps.png``.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from cxrdr.common.nih import BOX_FINDINGS
from cxrdr.train.evaluation.benchmark.localise import localise
from cxrdr.train.evaluation.benchmark.output import write_outputs
from cxrdr.train.evaluation.benchmark.prompts import finding_prompts
from cxrdr.train.evaluation.benchmark.rows import load_rows
from cxrdr.train.evaluation.embedding import as_eval_model, embed_images, embed_texts
from cxrdr.train.evaluation.probe import score_label
from cxrdr.train.evaluation.zeroshot import encode_prompts, prompt_scores

SCHEMES = ("nih-bbox",)


def parse_benchmark(spec: str) -> tuple[str, Path]:
    scheme, _, arg = str(spec).partition(":")
    if scheme not in SCHEMES or not arg:
        raise ValueError(f"bad benchmark {spec!r}: expected nih-bbox:PATH/nih_bbox.jsonl")
    return scheme, Path(arg)


def zero_shot(em, rows, img: np.ndarray, prompts: dict, batch_size: int = 64) -> dict:
    """Per-finding AUC of cos(image, positive prompts) - cos(image, negative prompts)."""
    emb = encode_prompts(lambda t: embed_texts(em, t, batch_size), {"labels": prompts})
    per = {}
    for finding in prompts:
        y = np.array([finding in r.findings for r in rows], dtype=float)
        if 0 < y.sum() < len(y):
            per[finding] = score_label(y, prompt_scores(img, emb[finding]))
    aucs = [v["auc"] for v in per.values()]
    return {"per_finding": per, "mean_auc": float(np.mean(aucs)) if aucs else float("nan"),
            "image_blind_auc": 0.5, "prompts": prompts}


def run_benchmark(model, spec: str, split: str = "test", out_dir=None, *, batch_size: int = 64,
                  n_plots: int = 6, device: str | None = None, progress: bool = True) -> dict:
    started = time.perf_counter()
    _, path = parse_benchmark(spec)
    em = as_eval_model(model, device)
    rows = load_rows(path, split)
    if not rows:
        raise ValueError(f"{path}: split {split!r} has no rows")
    img = embed_images(em, rows, batch_size, progress, f"embed {split} images")
    results = {"meta": {"model": em.name, "student": em.is_student, "benchmark": spec, "split": split,
                        "image_size": em.image_size, "findings": list(BOX_FINDINGS)},
               "zeroshot": zero_shot(em, rows, img, finding_prompts(), batch_size)}
    plots: list = []
    if em.is_student:
        results["localisation"], plots = localise(em, rows, load_rows(path, "train"), n_plots, progress)
    results["meta"]["n_images"] = len(rows)
    results["meta"]["n_boxes"] = sum(len(r.boxes) for r in rows)
    results["meta"]["seconds"] = round(time.perf_counter() - started, 2)
    results["summary"] = summary(results)
    if out_dir is not None:
        write_outputs(results, plots, Path(out_dir))
    return results


def summary(results: dict) -> dict:
    """The flat headline row: zero-shot mean AUC; per heatmap the pointing game and its three baselines."""
    out = {"zero_shot_auc_mean": results["zeroshot"]["mean_auc"], "n_images": results["meta"]["n_images"],
           "n_boxes": results["meta"]["n_boxes"]}
    lo = results.get("localisation") or {}
    for short, name in (("z", "mask"), ("attention", "attention")):
        overall = (lo.get(name) or {}).get("overall") or {}
        for metric in ("hit", "iou", "iobb_0.1", "iobb_0.25", "iobb_0.5"):
            head = "pg" if metric == "hit" else metric
            for baseline, suffix in (("model", ""), ("chance", "_chance"), ("loo_prior", "_prior"),
                                     ("train_prior", "_train_prior")):
                out[f"{head}_{short}{suffix}"] = (overall.get(baseline) or {}).get(metric)
        out[f"n_targets_{short}"] = overall.get("n")
        # image-bootstrap intervals of the pointing games, and the paired margin over the train-box prior
        for baseline, suffix in (("model", ""), ("train_prior", "_train_prior")):
            out[f"pg_{short}{suffix}_interval"] = (overall.get(baseline) or {}).get("hit_interval")
        margin = overall.get("margin_over_train_prior") or {}
        out[f"pg_{short}_minus_train_prior"] = margin.get("hit")
        out[f"pg_{short}_minus_train_prior_interval"] = margin.get("hit_interval")
    return out
