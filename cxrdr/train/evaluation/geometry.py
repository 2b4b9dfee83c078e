"""Embedding geometry: are a subject's images closer to each other than to other subjects'?

ratio = mean intra-subject distance / mean inter-subject distance (Euclidean between
L2-normalised embeddings). Below 1 means the space clusters by patient, which for a report
model is a warning sign (identity leaking) when it is far below 1, and is expected to be
mildly below 1 because a subject's studies share anatomy.
"""
from __future__ import annotations

import numpy as np


def distance_ratio(emb, subject_ids, max_items: int = 4000, seed: int = 0) -> dict:
    """Returns {"intra", "inter", "ratio", "n", "n_subjects", "n_intra_pairs"} (nan when undefined)."""
    x = np.asarray(emb, dtype=np.float64)
    ids = np.asarray([str(s) for s in subject_ids])
    if len(x) != len(ids):
        raise ValueError(f"{len(x)} embeddings for {len(ids)} subject ids")
    if len(x) > max_items:  # N^2 distances: subsample with a fixed seed
        keep = np.sort(np.random.default_rng(seed).choice(len(x), max_items, replace=False))
        x, ids = x[keep], ids[keep]
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    sq = np.clip(2.0 - 2.0 * (x @ x.T), 0.0, None)
    dist = np.sqrt(sq)
    same = ids[:, None] == ids[None, :]
    off_diag = ~np.eye(len(x), dtype=bool)
    intra_mask, inter_mask = same & off_diag, ~same
    intra = float(dist[intra_mask].mean()) if intra_mask.any() else float("nan")
    inter = float(dist[inter_mask].mean()) if inter_mask.any() else float("nan")
    ratio = intra / inter if inter_mask.any() and intra_mask.any() and inter > 0 else float("nan")
    return {"intra": intra, "inter": inter, "ratio": float(ratio), "n": int(len(x)),
            "n_subjects": int(len(set(ids.tolist()))), "n_intra_pairs": int(intra_mask.sum() // 2)}
