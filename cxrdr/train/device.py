"""The training device and mixed precision: which GPU this rank uses, and the autocast dtype."""
from __future__ import annotations

import contextlib

import torch

from cxrdr.train import distributed as dist_utils


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when available), 'cpu' or 'cuda' (this rank's GPU, LOCAL_RANK)."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return torch.device("cuda", dist_utils.local_rank())


def amp_dtype_for(amp: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype on CUDA; None (full precision) on CPU or with --amp none. bf16 falls back to
    fp16 on GPUs without bf16 (then a GradScaler is needed)."""
    if device.type != "cuda" or amp == "none":
        return None
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16 if amp == "bf16" else torch.float16


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast with ``dtype``, or a no-op context for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
