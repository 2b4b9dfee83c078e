"""The checkpoint file of a student: one torch.save dict, written atomically, read safely.
Rebuilding the model from it is ``cxrdr.train.checkpoint`` (this module builds no model, so the
model code may read checkpoints without an import cycle).

Layout: {"model_config": StudentConfig dict, "model": state_dict, **state} where state may hold
"optimizer", "scheduler", "scaler", "step", "rng", "train_config", "metrics", "best_score".
Text towers from a local path are stored by path (their weights are in the state dict anyway);
the 'tiny' tower's tokenizer is rebuilt from code.

Checkpoints are read with ``torch.load(weights_only=True)``: a ``.pt`` is a pickle, and a full
unpickler runs whatever code a crafted file names (``train eval --ckpt``, ``ckpt:`` teachers,
a planted ``last.pt`` on ``--resume``). So everything saved must be tensors and plain Python
types (dict, list, tuple, str, int, float, bool, None); ``plain_state`` converts the rest.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from cxrdr.common.atomic import replacing


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The student inside DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def plain_state(value):
    """``value`` as tensors and plain Python types only, so ``weights_only=True`` can read it back:
    numpy arrays become tensors, numpy scalars Python numbers, other objects their ``str``."""
    if isinstance(value, (torch.Tensor, torch.dtype, bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {k: plain_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_state(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, **state) -> Path:
    """Write {"model_config", "model", **state} to ``path`` atomically (temp file + rename)."""
    model = _unwrap(model)
    # The state_dict stays as torch made it (an OrderedDict with _metadata, which weights_only reads).
    payload = {"model_config": plain_state(model.config.to_dict()), "model": model.state_dict(),
               **plain_state(state)}
    with replacing(path) as tmp:
        torch.save(payload, tmp)
    return Path(path)


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """The raw checkpoint dict; a clear one-line error naming the file when missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not _torch_save_format(path):  # a JSON, YAML or image given by mistake: say that, not "refused to load it"
        raise ValueError(f"checkpoint {path} is not a PyTorch checkpoint (torch.save writes a zip archive); "
                         f"give a run's best.pt or last.pt")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused a global: code or foreign objects
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"checkpoint {path} holds objects other than tensors and plain values; refused to "
                         f"load it (loading could run code): {first}") from exc
    except Exception as exc:  # corrupt / truncated / not a torch file
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"checkpoint {path} is corrupt or not a torch checkpoint: {type(exc).__name__}: {first}") from exc
    if not isinstance(data, dict) or "model_config" not in data or "model" not in data:
        raise ValueError(f"checkpoint {path} is not a cxrdr student checkpoint (needs 'model_config' and 'model')")
    return data


def _torch_save_format(path: Path) -> bool:
    """A zip archive (torch.save since 1.6) or a legacy pickle stream (protocol 2+ starts with 0x80)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def load_training_state(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """The whole checkpoint dict for resuming: "model" (state_dict), "model_config", and whatever state was
    saved ("optimizer", "scheduler", "scaler", "step", "rng", ...); tensors mapped to ``map_location``."""
    return read_checkpoint(path, map_location)
