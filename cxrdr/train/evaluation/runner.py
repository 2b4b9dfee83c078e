"""`evaluate(model, shards_dir, split, out_dir)`: the whole evaluation suite on one shard split.

What is evaluated, and on which rows (all written to ``eval_ids.json`` so numbers reproduce):
- retrieval: one frontal image per study (first frontal by key order, else its first image)
  with that study's text; the text section is ``text_section`` ('both' = findings +
  impression, falling back to the stored report when a study has neither);
- linear probe: every image of ``train_split`` (at most ``probe_max_train``, an even stride
  over the split, so a fixed shard folder always gives the same rows) -> every image of ``split``;
- zero-shot AUC: every image of ``split``; 5x200-style accuracy on a seeded subset;
- geometry: every image of ``split`` by subject;
- localisation: the first ``n_localisation`` images of ``split`` with boxes (student only);
- faithfulness: the first ``n_faithfulness`` images of ``split`` (student only);
- efficiency: synthetic inputs at the model's size.
All images are the full stored image (identity view) at the model's input size, except for the
cross-view consistency which replays the first two stored augmentations.

``model`` is a PatchIBStudent, a loaded Teacher, or a spec: a checkpoint path / ``ckpt:PATH``
(loaded as the student, every metric) or any teacher spec (``openclip:...``, ``biomedclip``):
global metrics only (retrieval, probe, zero-shot, geometry, inference cost).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cxrdr.common.host_threads import host_threads
from cxrdr.common.phase_clock import PhaseClock
from cxrdr.common.shards import read_dataset_info
from cxrdr.common.views import one_per_study
from cxrdr.train.evaluation.efficiency import efficiency_metrics, image_encoder_metrics
from cxrdr.train.evaluation.embedding import EvalModel, as_eval_model, embed_images, embed_texts
from cxrdr.train.evaluation.geometry import distance_ratio
from cxrdr.train.evaluation.probe import linear_probe
from cxrdr.train.evaluation.report import write_eval_outputs
from cxrdr.train.evaluation.retrieval import retrieval_metrics
from cxrdr.train.evaluation.samples import (TEXT_SECTIONS, TrainSplitRows, load_split, retrieval_text,
                                             train_split_rows)
from cxrdr.train.evaluation.student_maps import localisation_and_faithfulness
from cxrdr.train.evaluation.zeroshot import (encode_prompts, load_prompts, multiclass_accuracy,
                                             select_5x200, zeroshot_auc)


def _split_counts(shards_dir) -> str:
    """'train 491, val 52, test 57': the samples of each split a shard folder's dataset.json records."""
    counts = (read_dataset_info(shards_dir).get("counts") or {}) if Path(shards_dir, "dataset.json").is_file() else {}
    return ", ".join(f"{name} {n}" for name, n in counts.items() if n) or "none recorded"


def evaluate(model, shards_dir, split: str = "test", out_dir=None, *, train_split: str = "train",
             train_shards=None,
             text_section: str = "both", batch_size: int = 64, max_samples: int | None = None,
             probe_max_train: int | None = 10000, prompts=None, min_positives: int = 5,
             n_5x200: int = 200, n_localisation: int = 64, n_faithfulness: int = 16,
             faith_steps: int = 10, top_fraction: float = 0.2, efficiency: bool = True,
             efficiency_batch: int = 32, n_plots: int = 6, seed: int = 0, device: str | None = None,
             progress: bool = True, quiet: bool = False, threads: int | None = None) -> dict:
    """Run every metric on ``split`` of ``shards_dir``; write eval.json/eval.md/PNGs to ``out_dir``.

    ``train_shards`` (default ``shards_dir``) holds the ``train_split`` the linear probe is fitted on and
    whose boxes make the train-box prior of the localisation: the report set may be a folder of its own.

    ``threads``: CPU threads for the host's part (decoding, views, metrics); default one when the model is on a
    GPU (its host work is small operations, which many threads slow down beside other busy processes:
    ``cxrdr.common.host_threads``), else the process's. ``meta.phase_s`` says what each part took.

    Returns the results dict (``results["summary"]`` is the flat row of headline numbers).
    """
    if text_section not in TEXT_SECTIONS:
        raise ValueError(f"text_section must be one of {TEXT_SECTIONS}, got {text_section!r}")
    em = as_eval_model(model, device)
    if threads is None and str(em.device).startswith("cuda"):
        threads = 1
    with host_threads(threads):
        clock = PhaseClock(digits=2)
        samples = load_split(shards_dir, split, max_samples)
        if not samples:
            raise ValueError(f"{shards_dir}: split {split!r} has no samples (its splits: {_split_counts(shards_dir)})")
        texts, fallbacks = zip(*(retrieval_text(s, text_section) for s in samples))
        texts = list(texts)
        results: dict = {"meta": {
            "model": em.name, "student": em.is_student, "shards": str(shards_dir), "split": split,
            "n_samples": len(samples), "text_section": text_section,
            "text_section_fallbacks_to_report": int(sum(fallbacks)), "seed": seed,
            "image_view": "full stored image (identity params) at the model input size",
            "image_size": em.image_size, "device": str(em.device), "threads": torch.get_num_threads()}}
        if em.is_student:
            results["meta"]["student_config"] = _config_dict(em.module)
        ids: dict = {"split": split, "text_section": text_section, "seed": seed}
        clock.lap("load")

        img = embed_images(em, samples, batch_size, progress, f"embed {split} images")
        clock.lap("embed")
        _retrieval(results, ids, em, samples, texts, img, batch_size)
        clock.lap("retrieval")
        ids["all"] = [s.key for s in samples]
        labels = np.asarray([s.labels for s in samples], dtype=np.float64)
        train_shards = shards_dir if train_shards is None else train_shards
        results["meta"]["train_shards"] = str(train_shards)
        train = train_split_rows(train_shards, train_split, probe_max_train)
        _probe(results, ids, em, train, train_split, img, labels, batch_size, min_positives, seed, progress, clock)
        _zeroshot(results, ids, em, samples, img, labels, prompts, batch_size, min_positives, n_5x200, seed)
        results["geometry"] = distance_ratio(img, [s.meta.get("subject_id", s.key) for s in samples], seed=seed)
        clock.lap("zeroshot_geometry")

        plots: dict = {}
        if em.is_student:
            localisation, faithfulness, plots = localisation_and_faithfulness(
                em, samples, texts, n_localisation, n_faithfulness, faith_steps, top_fraction, n_plots,
                seed, progress, train_boxes=list(train.boxes), batch_size=batch_size)
            results["localisation"], results["faithfulness"] = localisation, faithfulness
            ids.update(plots.get("ids", {}))
            clock.lap("localisation")
        if efficiency:
            results["efficiency"] = (efficiency_metrics(em.module, batch_size=efficiency_batch)
                                     if em.is_student else
                                     image_encoder_metrics(em.module.encode_images, em.image_size,
                                                           efficiency_batch, device=em.device))
            clock.lap("efficiency")
        results["meta"]["eval_seconds"] = clock.total()
        results["meta"]["phase_s"] = clock.seconds
        results["summary"] = summary_row(results)
        if out_dir is not None:
            write_eval_outputs(results, ids, plots, Path(out_dir), quiet=quiet)
        return results


def _retrieval(results: dict, ids: dict, em: EvalModel, samples: list, texts: list[str], img: np.ndarray,
               batch_size: int) -> None:
    """Retrieval over one frontal image per study and its text."""
    rows = one_per_study([s.key for s in samples], [s.meta.get("study_id") for s in samples],
                         [s.meta.get("view") for s in samples])
    txt = embed_texts(em, [texts[i] for i in rows], batch_size)
    findings = [finding_set(samples[i].labels) for i in rows]
    results["retrieval"] = retrieval_metrics(img[rows], txt, texts=[texts[i] for i in rows], findings=findings)
    results["retrieval"]["candidates"] = "one frontal image per study and its text"
    results["retrieval"]["findings_equivalence"] = "same set of positive labels"
    ids["retrieval"] = [samples[i].key for i in rows]


def finding_set(labels) -> tuple[int, ...]:
    """A study's finding set for findings-equivalent retrieval: the indices of its positive labels."""
    values = np.asarray(labels, dtype=np.float64)
    return tuple(int(i) for i in np.flatnonzero(values == 1))


def _zeroshot(results: dict, ids: dict, em: EvalModel, samples: list, img: np.ndarray, labels: np.ndarray,
              prompts, batch_size: int, min_positives: int, n_5x200: int, seed: int) -> None:
    """Zero-shot AUC on every image and 5x200-style accuracy on a seeded subset."""
    prompt_cfg = prompts if isinstance(prompts, dict) else load_prompts(prompts)
    prompt_emb = encode_prompts(lambda t: embed_texts(em, t, batch_size), prompt_cfg)
    results["zeroshot"] = zeroshot_auc(img, labels, prompt_emb, min_positives=min_positives)
    subset = select_5x200(labels, [s.key for s in samples], tuple(prompt_cfg["multiclass_5x200"]),
                          per_class=n_5x200, seed=seed)
    results["zeroshot_5x200"] = multiclass_accuracy(img, subset, prompt_emb)
    ids["zeroshot_5x200"] = {c: [samples[r].key for r in rs] for c, rs in subset.items()}


def _config_dict(student) -> dict:
    cfg = getattr(student, "config", None)
    if cfg is None:
        return {}
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))


def _probe(results: dict, ids: dict, em: EvalModel, train: TrainSplitRows, split: str, img: np.ndarray,
           labels: np.ndarray, batch_size: int, min_positives: int, seed: int, progress: bool,
           clock: PhaseClock) -> None:
    """The linear probe: fitted on the train split's probe rows, scored on the evaluated split's images."""
    if not train.probe:
        results["probe"] = {"skipped": f"no {split!r} split in the shards"}
        return
    chosen = list(train.probe)
    train_img = embed_images(em, chosen, batch_size, progress, f"embed {split} images")
    clock.lap("embed_train")
    results["probe"] = linear_probe(train_img, np.asarray([s.labels for s in chosen], dtype=np.float64), img, labels,
                                    min_positives=min_positives, seed=seed)
    results["probe"]["train_split"] = split
    ids["probe_train"] = [s.key for s in chosen]
    clock.lap("probe")


def _get(d: dict, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def summary_row(results: dict) -> dict:
    """The headline numbers of one evaluation, flat (the row of every table)."""
    r = results.get("retrieval", {})
    return {
        "i2t_R@1": r.get("i2t_R@1"), "i2t_R@5": r.get("i2t_R@5"), "i2t_R@10": r.get("i2t_R@10"),
        "t2i_R@1": r.get("t2i_R@1"), "t2i_R@5": r.get("t2i_R@5"), "t2i_R@10": r.get("t2i_R@10"),
        "mean_recall": r.get("mean_recall"), "chance_mean_recall": r.get("chance_mean_recall"),
        "mean_recall_sametext": r.get("mean_recall_sametext"),
        "mean_recall_findings": r.get("mean_recall_findings"),
        "oracle_mean_recall": r.get("oracle_mean_recall"),
        "n_candidates": r.get("n_candidates"),
        "probe_auc": _get(results, "probe", "mean_auc"), "probe_ap": _get(results, "probe", "mean_ap"),
        "zeroshot_auc": _get(results, "zeroshot", "mean_auc"),
        "zeroshot_5x200_acc": _get(results, "zeroshot_5x200", "accuracy"),
        "pointing_z": _get(results, "localisation", "mask", "pointing_game"),
        "iou_z": _get(results, "localisation", "mask", "iou"),
        "dice_z": _get(results, "localisation", "mask", "dice"),
        "chance_pointing_z": _get(results, "localisation", "mask", "chance_pointing_game"),
        "prior_pointing_z": _get(results, "localisation", "mask", "prior_pointing_game"),
        "train_prior_pointing_z": _get(results, "localisation", "mask", "train_prior_pointing_game"),
        "pointing_z_pathology": _get(results, "localisation", "mask", "pathology", "pointing_game"),
        "train_prior_pointing_z_pathology": _get(results, "localisation", "mask", "pathology",
                                                 "train_prior_pointing_game"),
        "pointing_attn": _get(results, "localisation", "attention", "pointing_game"),
        "chance_pointing_attn": _get(results, "localisation", "attention", "chance_pointing_game"),
        "prior_pointing_attn": _get(results, "localisation", "attention", "prior_pointing_game"),
        "train_prior_pointing_attn": _get(results, "localisation", "attention", "train_prior_pointing_game"),
        "iou_attn": _get(results, "localisation", "attention", "iou"),
        **localisation_intervals(results),
        "deletion_auc": _get(results, "faithfulness", "deletion_auc"),
        "insertion_auc": _get(results, "faithfulness", "insertion_auc"),
        "sparsity": _get(results, "faithfulness", "sparsity"),
        "cross_view_jaccard": _get(results, "faithfulness", "cross_view_jaccard"),
        "distance_ratio": _get(results, "geometry", "ratio"),
        "inference_img_per_s": _get(results, "efficiency", "inference_img_per_s"),
        "train_step_ms": _get(results, "efficiency", "train_step_ms"),
        "synthetic_train_img_per_s": _get(results, "efficiency", "train_img_per_s"),
        "latency_ms": _get(results, "efficiency", "latency_ms_per_img"),
        "peak_memory_mb": _get(results, "efficiency", "peak_memory_mb"),
        "step_memory_delta_mb": _get(results, "efficiency", "step_memory_delta_mb"),
        "gflops_per_img": _get(results, "efficiency", "gflops_per_img"),
        "patch_usage_pct": _get(results, "efficiency", "patch_usage_pct"),
    }


# summary column -> (heatmap block of results["localisation"], figure): the pointing games whose interval over
# images (``<column>_interval``) the summary carries beside them
INTERVAL_COLUMNS = {
    "pointing_z": (("mask",), "pointing_game"), "chance_pointing_z": (("mask",), "chance_pointing_game"),
    "prior_pointing_z": (("mask",), "prior_pointing_game"),
    "train_prior_pointing_z": (("mask",), "train_prior_pointing_game"),
    "pointing_z_pathology": (("mask", "pathology"), "pointing_game"),
    "train_prior_pointing_z_pathology": (("mask", "pathology"), "train_prior_pointing_game"),
    "pointing_attn": (("attention",), "pointing_game"),
    "chance_pointing_attn": (("attention",), "chance_pointing_game"),
    "prior_pointing_attn": (("attention",), "prior_pointing_game"),
    "train_prior_pointing_attn": (("attention",), "train_prior_pointing_game"),
}
# margin column -> heatmap block: the paired margin model - train-box prior and its interval over images
MARGIN_COLUMNS = {"margin_z_train_prior": ("mask",), "margin_z_pathology_train_prior": ("mask", "pathology"),
                  "margin_attn_train_prior": ("attention",)}


def localisation_intervals(results: dict) -> dict:
    """The summary's image-bootstrap columns: ``<column>_interval`` ([lo, hi]) beside each pointing game and
    its baselines, and ``margin_*_train_prior`` (PG − train-box prior, paired) with its ``_interval``."""
    out = {}
    for column, (path, figure) in INTERVAL_COLUMNS.items():
        out[f"{column}_interval"] = _get(results, "localisation", *path, f"{figure}_interval")
    for column, path in MARGIN_COLUMNS.items():
        out[column] = _get(results, "localisation", *path, "margin_over_train_prior")
        out[f"{column}_interval"] = _get(results, "localisation", *path, "margin_over_train_prior_interval")
    return out
