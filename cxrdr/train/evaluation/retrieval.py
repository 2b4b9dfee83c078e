"""Image<->report retrieval: Recall@K both ways, plus a variant where identical texts count.

Inputs are paired rows: image ``i`` belongs with text ``i`` (one frontal image per study and
that study's report). Normal CXR reports repeat verbatim a lot, so the strict metric punishes a
model for ranking another study's *identical* report first; the ``*_sametext`` variant counts
any candidate whose (whitespace/case-normalised) text equals the query's own text as correct.

Retrieval strictness: studies with the same findings differ only in the wording of their reports,
which an image cannot tell apart. With ``findings`` (one hashable finding set per row, e.g. the positive
labels) the ``*_findings`` variant counts any candidate with the query's finding set as correct, and
``oracle_mean_recall`` is the strict mean recall of a model that knows every study's findings and
nothing else (same-finding candidates first, in random order): the ceiling of the strict metric.

Ties are broken pessimistically (a wrong candidate with the same similarity as the right one
ranks ahead of it), so degenerate constant embeddings score chance, not 100%.
Recalls are fractions in [0, 1]; ``n_candidates`` is the gallery size of each direction.
"""
from __future__ import annotations

import re

import numpy as np
import torch

_SPACES = re.compile(r"\s+")


def normalise_text(text: str) -> str:
    """The text identity used by the identical-text variant: case and whitespace ignored."""
    return _SPACES.sub(" ", str(text)).strip().lower()


def _as_tensor(x) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x),
                        dtype=torch.float32)
    if t.ndim != 2:
        raise ValueError(f"embeddings must be 2-D (N, D), got shape {tuple(t.shape)}")
    return torch.nn.functional.normalize(t, dim=-1)


def correct_ranks(sim: torch.Tensor, correct: torch.Tensor | None = None,
                  chunk: int = 1024) -> np.ndarray:
    """0-based rank of the best correct candidate for each query row of ``sim`` (Q, G).

    ``correct`` (Q, G) bool marks right answers; None means the diagonal (query i <-> item i).
    Rank = number of wrong candidates scoring >= the best right one (pessimistic ties).
    """
    q, g = sim.shape
    ranks = np.empty(q, dtype=np.int64)
    for start in range(0, q, chunk):
        s = sim[start:start + chunk]
        if correct is None:
            rows = torch.arange(start, start + s.shape[0])
            ok = torch.zeros_like(s, dtype=torch.bool)
            ok[torch.arange(s.shape[0]), rows] = True
        else:
            ok = correct[start:start + chunk]
        if not bool(ok.any(dim=1).all()):
            raise ValueError("every query needs at least one correct candidate")
        best = s.masked_fill(~ok, float("-inf")).max(dim=1, keepdim=True).values
        ranks[start:start + s.shape[0]] = ((s >= best) & ~ok).sum(dim=1).numpy()
    return ranks


def _recalls(ranks: np.ndarray, ks, prefix: str, suffix: str = "") -> dict:
    out = {f"{prefix}_R@{k}{suffix}": float(np.mean(ranks < k)) for k in ks}
    out[f"{prefix}_median_rank{suffix}"] = float(np.median(ranks) + 1)
    return out


def _group_ids(keys) -> torch.Tensor:
    ids: dict = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in keys])


def oracle_mean_recall(findings, ks=(1, 5, 10)) -> float:
    """Expected strict mean recall of a findings oracle: the true item is uniformly placed among the g
    candidates that share its finding set (all ranked first), so R@K = min(K, g) / g per query."""
    groups = _group_ids(findings)
    sizes = torch.bincount(groups)[groups].double().numpy()
    return float(np.mean([np.mean(np.minimum(k, sizes) / sizes) for k in ks]))


def retrieval_metrics(img_emb, txt_emb, texts=None, ks=(1, 5, 10), findings=None) -> dict:
    """Recall@K image->text (i2t) and text->image (t2i) for paired rows.

    Returns ``{"i2t_R@1", ..., "t2i_R@10", "i2t_median_rank", "t2i_median_rank",
    "mean_recall" (mean of all i2t/t2i R@K), "n_candidates"}``; when ``texts`` (the N
    retrieval texts) are given, also the same keys with suffix ``_sametext`` (identical
    texts count as correct), "mean_recall_sametext" and "n_unique_texts"; with ``findings`` (one
    hashable finding set per row) the suffix ``_findings`` (same finding set counts as correct),
    "mean_recall_findings", "oracle_mean_recall" and "n_finding_sets".
    """
    img = _as_tensor(img_emb)
    txt = _as_tensor(txt_emb)
    if img.shape != txt.shape:
        raise ValueError(f"image and text embeddings must pair row by row: {tuple(img.shape)} "
                         f"vs {tuple(txt.shape)}")
    n = img.shape[0]
    if n == 0:
        raise ValueError("retrieval needs at least one image-text pair")
    ks = tuple(int(k) for k in ks)
    sim = img @ txt.T
    out = {}
    out.update(_recalls(correct_ranks(sim), ks, "i2t"))
    out.update(_recalls(correct_ranks(sim.T.contiguous()), ks, "t2i"))
    out["mean_recall"] = float(np.mean([out[f"{d}_R@{k}"] for d in ("i2t", "t2i") for k in ks]))
    out["n_candidates"] = int(n)
    # a random ranking puts the one correct item in the top K with probability K / N
    out["chance_mean_recall"] = float(np.mean([min(k, n) / n for k in ks])) if n else float("nan")
    if texts is not None:
        if len(texts) != n:
            raise ValueError(f"texts has {len(texts)} entries for {n} embedding pairs")
        groups = _group_ids([normalise_text(t) for t in texts])
        out.update(_grouped_recalls(sim, groups, ks, "_sametext"))
        out["n_unique_texts"] = int(groups.max()) + 1
    if findings is not None:
        if len(findings) != n:
            raise ValueError(f"findings has {len(findings)} entries for {n} embedding pairs")
        groups = _group_ids(findings)
        out.update(_grouped_recalls(sim, groups, ks, "_findings"))
        out["oracle_mean_recall"] = oracle_mean_recall(findings, ks)
        out["n_finding_sets"] = int(groups.max()) + 1
    return out


def _grouped_recalls(sim: torch.Tensor, groups: torch.Tensor, ks, suffix: str) -> dict:
    """R@K both ways where every candidate of the query's group counts as correct, and their mean."""
    same = groups[:, None] == groups[None, :]
    out = _recalls(correct_ranks(sim, same), ks, "i2t", suffix)
    out.update(_recalls(correct_ranks(sim.T.contiguous(), same.T.contiguous()), ks, "t2i", suffix))
    out[f"mean_recall{suffix}"] = float(np.mean([out[f"{d}_R@{k}{suffix}"] for d in ("i2t", "t2i") for k in ks]))
    return out
