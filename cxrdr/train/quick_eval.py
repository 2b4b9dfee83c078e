"""The in-training validation pass: retrieval R@K and a quick linear-probe AUC, one score.

Cheap on purpose (the full suite is ``train eval``): embed the split once with the full-image
view, keep one frontal image per study with its report for retrieval (the rows ``train eval``
picks: :func:`cxrdr.common.views.one_per_study`), and fit the linear probe
on one half of the split's subjects and score it on the other half. The metric functions are
the evaluation package's (``cxrdr.train.evaluation.retrieval`` / ``probe``) so numbers agree.

Early-stopping score: ``w * mean Recall + (1 - w) * mean AUC`` (a missing AUC counts as 0.5,
chance, so a split too small for any probe label, or a pass without the probe, ranks checkpoints by
retrieval).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from cxrdr.common.augment import stable_seed
from cxrdr.common.host_threads import host_threads
from cxrdr.common.phase_clock import PhaseClock
from cxrdr.common.views import one_per_study
from cxrdr.train.device import autocast
from cxrdr.train.evaluation.probe import linear_probe
from cxrdr.train.evaluation.retrieval import retrieval_metrics
from cxrdr.train.evaluation.zeroshot import encode_prompts, zeroshot_auc


@torch.no_grad()
def collect_embeddings(model, loader, device, amp_dtype=None, max_samples: int | None = None) -> dict:
    """Image/report embeddings (normalised, CPU float32) and metadata for every sample of a loader."""
    was_training = model.training
    model.eval()
    img, txt, labels, study, subject, view, text, keys = [], [], [], [], [], [], [], []
    seen = 0
    # one autocast region for the whole pass: the weights (unchanged within it) are cast once, not per batch
    with autocast(device, amp_dtype):
        for batch in loader:
            out_img = model.encode_image(batch["images"].to(device, non_blocking=True))
            out_txt = model.encode_text(batch["report_ids"].to(device), batch["report_mask"].to(device),
                                        batch.get("report_token_index"))
            img.append(out_img.float().cpu())
            txt.append(out_txt.float().cpu())
            labels.append(batch["labels"])
            study += batch["study_id"]
            subject += batch["subject_id"]
            view += batch["view"]
            text += batch["report_text"]
            keys += batch["key"]
            seen += len(batch["key"])
            if max_samples and seen >= max_samples:
                break
    model.train(was_training)
    if not img:
        raise ValueError("evaluation split is empty")
    return {"img": torch.cat(img).numpy(), "txt": torch.cat(txt).numpy(),
            "labels": torch.cat(labels).numpy(), "study_id": study, "subject_id": subject,
            "view": view, "report_text": text, "key": keys}


def quick_probe(emb: np.ndarray, labels: np.ndarray, subjects: list, seed: int = 0,
                min_positives: int = 2, threads: int | None = None) -> dict:
    """Linear probe fitted on half the subjects of the split and scored on the other half, on ``threads`` CPU
    threads (None: the process's; a CPU run with busy loader workers asks for one: on 2 cores with 4 busy processes
    beside it a 512-row probe took 0.5-1.4 s on every core's thread, 0.4-0.5 s on one; idle, 0.13 and 0.19 s)."""
    halves = np.array([stable_seed("probe", seed, s) % 2 for s in subjects])
    if halves.all() or not halves.any():  # one subject only: split rows instead
        halves = np.arange(len(subjects)) % 2
    train, test = halves == 0, halves == 1
    with host_threads(threads):
        return linear_probe(emb[train], labels[train], emb[test], labels[test],
                            min_positives=min_positives, max_iter=500, seed=seed)


def early_stop_score(metrics: dict, weight: float = 0.5) -> float:
    auc = metrics.get("probe_mean_auc")
    auc = 0.5 if auc is None or (isinstance(auc, float) and math.isnan(auc)) else auc
    return float(weight * metrics.get("mean_recall", 0.0) + (1 - weight) * auc)


@torch.no_grad()
def quick_zeroshot(model, img: np.ndarray, labels: np.ndarray, prompts: dict, device, min_positives: int = 2) -> float:
    """Zero-shot mean AUC of the prompts' labels (CheXpert-14 vector) through the model's own text tower."""
    def embed(texts):
        tok = model.tokenize(list(texts))
        out = model.encode_text(tok["input_ids"].to(device), tok["attention_mask"].to(device))
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu().numpy()

    was_training = model.training
    model.eval()
    try:
        return zeroshot_auc(img, labels, encode_prompts(embed, prompts), min_positives=min_positives)["mean_auc"]
    finally:
        model.train(was_training)


def quick_evaluate(model, loader, device, amp_dtype=None, recall_weight: float = 0.5,
                   max_samples: int | None = None, seed: int = 0, prompts: dict | None = None,
                   probe: bool = True, threads: int | None = None, probe_threads: int | None = None) -> dict:
    """Retrieval (one frontal image per study) + quick probe AUC (unless not ``probe``; + zero-shot mean AUC with
    ``prompts``) + the early-stopping score, and the seconds of each phase (``eval_phase_s``: a run validates
    20-40 times, so which phase its passes spend on is worth a line of the log).

    ``threads``: the pass's CPU threads, torch's and BLAS's (None: the process's). The loop asks for one when its
    model is on a GPU: the host's part (retrieval on a few hundred rows, the probe) gives each thread too little
    work to pay for waiting on ones that busy loader workers deschedule (``cxrdr.common.host_threads``: on the H200
    a pass's retrieval took 0.7 s beside two runs' workers, 10 ms on this idle box). ``probe_threads``: the probe's
    alone (``quick_probe``), for a CPU run whose pass needs every thread for its model."""
    with host_threads(threads):
        return _quick_evaluate(model, loader, device, amp_dtype, recall_weight, max_samples, seed, prompts, probe,
                               probe_threads)


def _quick_evaluate(model, loader, device, amp_dtype, recall_weight, max_samples, seed, prompts, probe,
                    probe_threads) -> dict:
    clock = PhaseClock()
    data = collect_embeddings(model, loader, device, amp_dtype, max_samples)
    clock.lap("embed")  # the embeddings come back to the host: the device's work is in it
    rows = one_per_study(data["key"], data["study_id"], data["view"])
    metrics = retrieval_metrics(data["img"][rows], data["txt"][rows],
                                texts=[data["report_text"][i] for i in rows])
    clock.lap("retrieval")
    if probe:
        try:
            fitted = quick_probe(data["img"], data["labels"], data["subject_id"], seed=seed, threads=probe_threads)
            metrics["probe_mean_auc"] = fitted["mean_auc"]
            metrics["probe_n_labels"] = fitted["n_labels"]
        except ValueError as exc:  # too few rows for a probe: retrieval alone ranks checkpoints
            metrics["probe_mean_auc"] = float("nan")
            metrics["probe_error"] = str(exc)
        clock.lap("probe")
    if prompts:
        metrics["zeroshot_mean_auc"] = quick_zeroshot(model, data["img"], data["labels"], prompts, device)
        clock.lap("zeroshot")
    metrics["n_eval"] = len(data["key"])
    metrics["score"] = early_stop_score(metrics, recall_weight)
    metrics["eval_phase_s"] = clock.seconds
    return metrics
