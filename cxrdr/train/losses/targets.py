"""Target matrices of the contrastive terms: which pairs count as positives, and with what weight.

A *target matrix* T (B, B) is row-stochastic: T[i, j] is the probability that anchor i (the image
for i2t, the text for t2i) pairs with candidate j. Every target used here (identity, uniform over
positives, label similarity) is symmetric in meaning, so the same matrix serves both directions.
- in-batch negatives: T = identity (default);
- false negatives: a (B, B) bool `positives` (diagonal always true; `positive_mask` builds it from
  same subject / same study / identical report text). fn_mode="multi": T uniform over positives;
  fn_mode="mask": off-diagonal positives are removed from the softmax denominator, T = identity;
- label soft targets (MedCLIP): T = softmax(cos(label_i, label_j) / tau) over j; they replace the
  positives-derived targets ("mask" mode still removes the positives from the denominator).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from cxrdr.train.device import to_device
from cxrdr.train.losses.config import FN_CRITERIA


def id_list(values: Any) -> list | None:
    if values is None:
        return None
    if torch.is_tensor(values):
        return values.tolist()
    return list(values)


def _norm_text(text: Any) -> str | None:
    if text is None:
        return None
    norm = " ".join(str(text).split()).lower()
    return norm or None


def positive_mask(
    subject_ids: Sequence | torch.Tensor | None = None,
    study_ids: Sequence | torch.Tensor | None = None,
    texts: Sequence[str] | None = None,
    criteria: Sequence[str] = FN_CRITERIA,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(B, B) bool: i and j share a subject, a study, or an identical text (whitespace/case
    normalised); the diagonal is always true. Missing ids ('' or None) never match."""
    columns = {"subject": id_list(subject_ids), "study": id_list(study_ids), "text": id_list(texts)}
    lengths = {len(v) for v in columns.values() if v is not None}
    if len(lengths) > 1:
        raise ValueError(f"positive_mask: subject/study/text lists differ in length: {sorted(lengths)}")
    if not lengths:
        raise ValueError("positive_mask: give at least one of subject_ids, study_ids, texts")
    n = lengths.pop()
    mask = torch.eye(n, dtype=torch.bool)
    for name in criteria:
        values = columns.get(name)
        if values is None:
            continue
        if name == "text":
            values = [_norm_text(v) for v in values]
        else:
            values = [None if v is None or v == "" else v for v in values]
        # integer codes per distinct value (-1 = missing), compared as a (B, B) outer equality
        table: dict = {}
        codes = torch.tensor([-1 if v is None else table.setdefault(v, len(table)) for v in values])
        mask |= (codes[:, None] == codes[None, :]) & (codes[:, None] >= 0)
    return to_device(mask, device) if device is not None else mask


def label_soft_targets(labels: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """MedCLIP-style targets: softmax_j(cos(l_i, l_j) / temperature), rows summing to 1.

    `labels` (B, C) label vectors in [0, 1] (NaN and negatives count as 0). An all-zero row gets an
    extra "no label" dimension so that two unlabelled/normal studies are similar to each other.
    """
    lab = torch.nan_to_num(labels.detach().float(), nan=0.0).clamp_min(0.0)
    empty = (lab.sum(dim=1, keepdim=True) == 0).float()
    vec = F.normalize(torch.cat([lab, empty], dim=1), dim=1)
    return torch.softmax(vec @ vec.T / temperature, dim=1)


def target_matrix(n: int, positives: torch.Tensor | None, soft_targets: torch.Tensor | None,
                  fn_mode: str, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(targets (n, n) row-stochastic, exclude (n, n) bool or None) for the options above."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    exclude = None
    if positives is not None:
        if tuple(positives.shape) != (n, n):
            raise ValueError(f"positives must be ({n}, {n}), got {tuple(positives.shape)}")
        positives = positives.to(device=device, dtype=torch.bool) | eye
        if fn_mode == "mask":
            exclude = positives & ~eye
    if soft_targets is not None:
        if tuple(soft_targets.shape) != (n, n):
            raise ValueError(f"soft_targets must be ({n}, {n}), got {tuple(soft_targets.shape)}")
        targets = soft_targets.to(device=device, dtype=dtype)
    elif positives is not None and fn_mode == "multi":
        targets = positives.to(dtype)
        targets = targets / targets.sum(dim=1, keepdim=True)
    else:
        targets = eye.to(dtype)
    return targets, exclude
