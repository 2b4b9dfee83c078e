"""Linear probe: logistic regression on frozen image embeddings, per-label AUC and AP.

Trained on the train split's embeddings, scored on the test split's. A label is skipped (and
listed with the reason) when either split has fewer than ``min_positives`` positives or the
test split has no negatives: its AUC would be noise or undefined. Labels are binarised at 0.5,
so whatever the shards stored for "uncertain" (U-ones: 1.0) decides how it counts.
"""
from __future__ import annotations

import warnings

import numpy as np

from cxrdr.common.labels import CHEXPERT14


def binarise(labels) -> np.ndarray:
    """(N, L) label values -> bool positives (> 0.5); NaN/None count as negative."""
    arr = np.asarray(labels, dtype=np.float64)
    return np.nan_to_num(arr, nan=0.0) > 0.5


def label_skip_reason(y_train: np.ndarray | None, y_test: np.ndarray, min_positives: int) -> str | None:
    """Why a label cannot be scored, or None when it can."""
    if y_train is not None and int(y_train.sum()) < min_positives:
        return f"{int(y_train.sum())} train positives < {min_positives}"
    if y_train is not None and int((~y_train).sum()) < 1:
        return "no train negatives"
    if int(y_test.sum()) < min_positives:
        return f"{int(y_test.sum())} test positives < {min_positives}"
    if int((~y_test).sum()) < 1:
        return "no test negatives"
    return None


def score_label(y_true: np.ndarray, scores: np.ndarray) -> dict:
    from sklearn.metrics import average_precision_score, roc_auc_score

    return {"auc": float(roc_auc_score(y_true, scores)),
            "ap": float(average_precision_score(y_true, scores)),
            "n_pos": int(y_true.sum()), "n": int(len(y_true))}


def summarise(per_label: dict, skipped: dict, **extra) -> dict:
    aucs = [v["auc"] for v in per_label.values()]
    aps = [v["ap"] for v in per_label.values()]
    return {"mean_auc": float(np.mean(aucs)) if aucs else float("nan"),
            "mean_ap": float(np.mean(aps)) if aps else float("nan"),
            "n_labels": len(per_label), "per_label": per_label, "skipped": skipped, **extra}


def linear_probe(train_emb, train_labels, test_emb, test_labels,
                 label_names=CHEXPERT14, min_positives: int = 5, C: float = 1.0,
                 max_iter: int = 2000, seed: int = 0) -> dict:
    """Fit one logistic regression per label on train embeddings; AUC/AP on test.

    Returns ``{"mean_auc", "mean_ap", "n_labels", "per_label": {name: {"auc","ap","n_pos","n",
    "n_pos_train"}}, "skipped": {name: reason}, "n_train", "n_test", "min_positives"}``.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x_train = np.asarray(train_emb, dtype=np.float64)
    x_test = np.asarray(test_emb, dtype=np.float64)
    y_train_all, y_test_all = binarise(train_labels), binarise(test_labels)
    if y_train_all.shape[1] != len(label_names) or y_test_all.shape[1] != len(label_names):
        raise ValueError(f"label matrices have {y_train_all.shape[1]}/{y_test_all.shape[1]} columns "
                         f"for {len(label_names)} label names")
    if len(x_train) != len(y_train_all) or len(x_test) != len(y_test_all):
        raise ValueError("embeddings and labels differ in length")
    per_label, skipped = {}, {}
    for j, name in enumerate(label_names):
        y_tr, y_te = y_train_all[:, j], y_test_all[:, j]
        reason = label_skip_reason(y_tr, y_te, min_positives)
        if reason:
            skipped[name] = reason
            continue
        clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=max_iter,
                                                                 random_state=seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter on tiny sets
            clf.fit(x_train, y_tr)
        per_label[name] = {**score_label(y_te, clf.predict_proba(x_test)[:, 1]),
                           "n_pos_train": int(y_tr.sum())}
    return summarise(per_label, skipped, n_train=int(len(x_train)), n_test=int(len(x_test)),
                     min_positives=min_positives)
