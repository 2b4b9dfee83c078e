"""The training device and mixed precision: which GPU this rank uses, the autocast dtype, the CUDA
math settings of a training process, and host-to-device copies that do not wait for the GPU."""
from __future__ import annotations

import contextlib
import os

import torch

from cxrdr.common.host_threads import available_cores, gpu_host_workers
from cxrdr.train import distributed as dist_utils

CPU_WORKERS = 2  # the loader workers' default off a GPU: the model's own threads need the cores


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when available), 'cpu' or 'cuda' (this rank's GPU, LOCAL_RANK)."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return torch.device("cuda", dist_utils.local_rank())


def loader_workers(workers: int | None, device: torch.device | str) -> int:
    """``--workers``, or its default on ``device``: 2 on the CPU; on CUDA this host's cores but two, shared by its ranks
    (torchrun's LOCAL_WORLD_SIZE), at least 2 and at most 16 a rank. Why so many: at 224 px a worker prepares ~400
    samples/s (a sample's decode, replay and texts: ``benchmarks/data_path.py``) and a ViT-S/16 D step on one H200
    trains ~3,000 img/s, so two workers would leave the GPU waiting most of each step."""
    if workers is not None:
        return int(workers)
    if not (str(device).startswith("cuda") or (str(device) == "auto" and torch.cuda.is_available())):
        return CPU_WORKERS
    return gpu_host_workers(available_cores(), processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def amp_dtype_for(amp: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype on CUDA; None (full precision) on CPU or with --amp none. bf16 falls back to
    fp16 on GPUs without bf16 (then a GradScaler is needed)."""
    if device.type != "cuda" or amp == "none":
        return None
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16 if amp == "bf16" else torch.float16


def autocast(device: torch.device, dtype: torch.dtype | None, cache: bool = True):
    """torch.autocast with ``dtype``, or a no-op context for full precision. ``cache=False``: no cache of the
    weights' casts (CUDA graph capture refuses it: models/block_graphs.py)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache)


def to_device(x, device: torch.device | str):
    """``x`` (a tensor, or a dict/list/tuple of them; anything else as it is) on ``device``, copied
    without a host sync: from page-locked memory (the loaders pin their batches on CUDA, other host
    tensors are pinned here) with ``non_blocking``. A plain ``.to('cuda')`` of pageable memory waits
    for every kernel queued before it: one sync per tensor per step."""
    device = torch.device(device)
    if torch.is_tensor(x):
        if x.device == device:
            return x
        if device.type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
            x = x.pin_memory()
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and any(torch.is_tensor(v) for v in x):
        return type(x)(to_device(v, device) for v in x)
    return x


@contextlib.contextmanager
def training_cuda_math():
    """``cuda_math_settings`` for a block, the process's previous settings restored after it: a
    measurement (``cxrdr.train.evaluation.efficiency``) runs as the loop does without changing the
    numerics of the rest of its process (e.g. ``train eval``)."""
    backends = torch.backends
    sdp = getattr(backends.cuda, "cudnn_sdp_enabled", None)
    saved = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
             sdp() if sdp is not None else None)
    cuda_math_settings()
    try:
        yield
    finally:
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])
        if saved[3] is not None:
            backends.cuda.enable_cudnn_sdp(saved[3])


def cuda_math_settings() -> None:
    """TF32 for the float32 matmuls and convolutions autocast leaves (losses, norms), and the fused
    SDPA kernels preferred over cuDNN's attention, whose launch cost ~1 ms of CPU per call on the
    first H100 profile (../shared/gpu: loop-profile). Process-wide: a training process calls it once."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
