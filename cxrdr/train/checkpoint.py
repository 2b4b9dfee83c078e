"""Checkpoints of a student: ``load_checkpoint`` rebuilds the model from the config it was saved with.

The file format (layout, safe reading, atomic writing) is ``cxrdr.train.checkpoint_io``; its
functions are re-exported here so callers have one checkpoint module.
"""
from __future__ import annotations

import os

import torch

from cxrdr.train.checkpoint_io import load_training_state, plain_state, read_checkpoint, save_checkpoint
from cxrdr.train.models.factory import build_student

__all__ = ["load_checkpoint", "load_training_state", "plain_state", "read_checkpoint", "save_checkpoint"]


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Rebuild the student from the checkpoint's config, load its weights strictly, eval mode on ``device``."""
    data = read_checkpoint(path)
    try:
        model = build_student(dict(data["model_config"]), init_weights=False)
        model.load_state_dict(data["model"], strict=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"checkpoint {path}: cannot rebuild the student: {exc}") from exc
    return model.to(device).eval()
