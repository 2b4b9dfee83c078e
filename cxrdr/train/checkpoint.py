"""Checkpoints of a student: ``load_checkpoint`` rebuilds the model from the config it was saved with.

The file format (layout, safe reading, atomic writing) is ``cxrdr.train.checkpoint_io``; its
functions are re-exported here so callers have one checkpoint module.
"""
from __future__ import annotations

import os

import torch

from cxrdr.train.checkpoint_io import load_training_state, plain_state, read_checkpoint, save_checkpoint
from cxrdr.train.models.factory import build_student

__all__ = ["init_from_checkpoint", "load_checkpoint", "load_training_state", "plain_state", "read_checkpoint", "save_checkpoint"]


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Rebuild the student from the checkpoint's config, load its weights strictly, eval mode on ``device``."""
    data = read_checkpoint(path)
    try:
        model = build_student(dict(data["model_config"]), init_weights=False)
        model.load_state_dict(data["model"], strict=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"checkpoint {path}: cannot rebuild the student: {exc}") from exc
    return model.to(device).eval()


def init_from_checkpoint(model: torch.nn.Module, path: str | os.PathLike) -> dict:
    """Load a checkpoint's weights into ``model`` (a new run's student) to start from them. Every tensor must
    match by name and shape, except the training-only distillation heads (``teacher_heads``: one per teacher
    of the run, so they differ between the runs' shards), which keep their fresh initialisation."""
    state = read_checkpoint(path)["model"]
    own = model.state_dict()
    heads = "teacher_heads."
    wrong = sorted(k for k in own if not k.startswith(heads) and (k not in state or state[k].shape != own[k].shape))
    extra = sorted(k for k in state if not k.startswith(heads) and k not in own)
    if wrong or extra:
        raise ValueError(f"init checkpoint {path}: not the run's architecture ({len(wrong)} tensors missing or of "
                         f"another shape, e.g. {(wrong or extra)[:3]}; {len(extra)} unknown)")
    loaded = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(loaded, strict=False)
    return {"init_ckpt": str(path), "tensors": len(loaded), "fresh": sorted(set(own) - set(loaded))}
