"""Small stand-ins shared by tests (no model needed)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FakeOutput:
    """Stand-in for train.models.StudentOutput (only the fields the losses read)."""

    image_emb: torch.Tensor
    text_emb: torch.Tensor
    logit_scale: torch.Tensor
    mask: torch.Tensor | None = None
    mask_scores: torch.Tensor | None = None
    masked_image_emb: torch.Tensor | None = None
    local_visual: torch.Tensor | None = None
    local_text: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None
    local_pair_similarity: torch.Tensor | None = None
    local_pair_mask: torch.Tensor | None = None
    local_attn: torch.Tensor | None = None
    local_word_similarity: torch.Tensor | None = None
    local_pair_ids: torch.Tensor | None = None
    local_pair_index: torch.Tensor | None = None
    local_drawable_ids: torch.Tensor | None = None
    local_word_idf: torch.Tensor | None = None
    teacher_space: dict | None = None
