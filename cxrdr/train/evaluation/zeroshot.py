"""Zero-shot classification from text prompts: per-label AUC, and 5x200-style accuracy.

For each label the positive prompts and the negative prompts (``configs/prompts.yaml``) are
embedded and averaged (then re-normalised). An image's score is cos(image, positive) -
cos(image, negative): with a softmax over the two prompts at any temperature, the positive
probability is monotone in that difference, so the AUC is the same. A label without negative
prompts is scored by cos(image, positive) alone. Labels with fewer than ``min_positives``
test positives are skipped and listed, as in the linear probe.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cxrdr.common.configs import prompts_file
from cxrdr.common.labels import CHEXPERT14
from cxrdr.common.yamlio import safe_load
from cxrdr.train.evaluation.probe import binarise, label_skip_reason, score_label, summarise

CLASSES_5X200 = ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion")


def load_prompts(path: str | Path | None = None) -> dict:
    """``{"labels": {name: {"positive": [...], "negative": [...]}}, "multiclass_5x200": [...]}``."""
    path = Path(path) if path else prompts_file()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    data = safe_load(path.read_text()) or {}
    labels = data.get("labels")
    if not isinstance(labels, dict) or not labels:
        raise ValueError(f"{path}: expected a non-empty 'labels:' mapping of label -> prompts")
    for name, spec in labels.items():
        if not isinstance(spec, dict) or not spec.get("positive"):
            raise ValueError(f"{path}: label {name!r} needs a non-empty 'positive' prompt list")
    data.setdefault("multiclass_5x200", list(CLASSES_5X200))
    return data


def _mean_direction(emb) -> np.ndarray:
    v = np.asarray(emb, dtype=np.float64).reshape(-1, np.asarray(emb).shape[-1]).mean(axis=0)
    return v / max(np.linalg.norm(v), 1e-12)


def encode_prompts(embed_texts, prompts: dict) -> dict:
    """Embed every label's prompts with ``embed_texts(list[str]) -> (n, D)``: {name: (pos, neg|None)}."""
    out = {}
    for name, spec in prompts["labels"].items():
        pos = _mean_direction(np.asarray(embed_texts(list(spec["positive"]))))
        neg = spec.get("negative") or []
        out[name] = (pos, _mean_direction(np.asarray(embed_texts(list(neg)))) if neg else None)
    return out


def prompt_scores(img_emb, directions: tuple) -> np.ndarray:
    x = np.asarray(img_emb, dtype=np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    pos, neg = directions
    return x @ pos - (x @ neg if neg is not None else 0.0)


def zeroshot_auc(img_emb, labels, prompt_emb: dict, label_names=CHEXPERT14,
                 min_positives: int = 5) -> dict:
    """Per-label AUC/AP of prompt scores; labels without prompts or with too few positives skipped."""
    y_all = binarise(labels)
    per_label, skipped = {}, {}
    for j, name in enumerate(label_names):
        if name not in prompt_emb:
            skipped[name] = "no prompts"
            continue
        reason = label_skip_reason(None, y_all[:, j], min_positives)
        if reason:
            skipped[name] = reason
            continue
        per_label[name] = score_label(y_all[:, j], prompt_scores(img_emb, prompt_emb[name]))
    return summarise(per_label, skipped, n_test=int(len(y_all)), min_positives=min_positives)


def select_5x200(labels, ids, classes=CLASSES_5X200, per_class: int = 200, seed: int = 0,
                 label_names=CHEXPERT14) -> dict:
    """CheXpert 5x200-style subset: images positive for exactly one of ``classes``, at most
    ``per_class`` each, drawn with a fixed seed. Returns {class: [row indices]} (sorted)."""
    y = binarise(labels)
    cols = [list(label_names).index(c) for c in classes]
    sub = y[:, cols]
    single = sub.sum(axis=1) == 1
    rng = np.random.default_rng(seed)
    out = {}
    for i, name in enumerate(classes):
        rows = np.flatnonzero(single & sub[:, i])
        rows = rows[np.argsort([str(ids[r]) for r in rows], kind="stable")]  # order-independent draw
        if len(rows) > per_class:
            rows = np.sort(rng.choice(rows, per_class, replace=False))
        out[name] = [int(r) for r in rows]
    return out


def multiclass_accuracy(img_emb, subset: dict, prompt_emb: dict) -> dict:
    """Accuracy of argmax over the classes' positive-prompt similarity on a 5x200-style subset."""
    classes = [c for c in subset if c in prompt_emb]
    rows = [(r, i) for i, c in enumerate(classes) for r in subset[c]]
    if len(classes) < 2 or not rows:
        return {"accuracy": float("nan"), "n": 0, "classes": classes}
    x = np.asarray(img_emb, dtype=np.float64)[[r for r, _ in rows]]
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    centres = np.stack([prompt_emb[c][0] for c in classes])
    pred = (x @ centres.T).argmax(axis=1)
    truth = np.array([i for _, i in rows])
    return {"accuracy": float((pred == truth).mean()), "n": int(len(rows)), "classes": classes,
            "per_class_n": {c: len(subset[c]) for c in classes}}
