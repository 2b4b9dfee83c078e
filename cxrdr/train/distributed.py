"""torchrun / DDP helpers: process-group set-up, rank queries, feature gathering for the losses.

Gathering follows open_clip's "gather_with_grad=False, local features replaced" recipe: every
rank all-gathers the features of the others (no gradient) and puts its own local tensor, which
keeps its autograd graph, at its own slice. Every rank then computes the loss of the *global*
batch, and the gradient that reaches the local features is exactly the single-process gradient of
the global loss with respect to them.

One consequence the training loop must apply: DDP *averages* parameter gradients over ranks, so
with every rank holding the global loss the averaged parameter gradient is 1/world_size of the
single-process gradient. Multiply the loss by `loss_scale_for_ddp()` (== world_size) before
`backward()` to get exactly the single-process gradient (log the unscaled value). The per-sample
terms in `cxrdr.train.losses` are built with `global_mean`, and parameters every rank uses in full (the
logit scale) pass through `replicated`, so that the same rule holds for every parameter. The
training objective (`cxrdr.train.losses.objective.Objective`) gathers each feature once.

Without an initialised process group every helper is a cheap no-op (world size 1, rank 0).
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def is_dist() -> bool:
    """True when a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Rank 0 (or no process group): the process that logs, evaluates and writes checkpoints."""
    return rank() == 0


def loss_scale_for_ddp() -> int:
    """Factor for `backward()` so DDP's gradient averaging yields the single-process gradient."""
    return world_size()


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> bool:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, ...).

    Returns True when a group with more than one rank is running. Backend: nccl when CUDA is
    available, else gloo (override with `backend`). On CUDA the current device is set to LOCAL_RANK.
    Does nothing (returns False) when WORLD_SIZE is absent or 1, so plain `python` runs work unchanged.
    """
    if dist.is_initialized():
        return is_dist()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return False
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("WORLD_SIZE>1 but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return is_dist()


def barrier() -> None:
    if is_dist():
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group (safe to call when none exists)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _all_gather_tensor(x: torch.Tensor) -> list[torch.Tensor]:
    """all_gather that tolerates a different first dimension per rank (pads, then trims)."""
    n_local = torch.tensor([x.shape[0]], device=x.device, dtype=torch.long)
    sizes = [torch.zeros_like(n_local) for _ in range(world_size())]
    dist.all_gather(sizes, n_local)
    sizes_int = [int(s.item()) for s in sizes]
    n_max = max(sizes_int)
    padded = x.detach()
    if x.shape[0] < n_max:
        pad = x.new_zeros((n_max - x.shape[0], *x.shape[1:]))
        padded = torch.cat([padded, pad], dim=0)
    out = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(out, padded.contiguous())
    return [o[:n] for o, n in zip(out, sizes_int)]


def gather_features(x: torch.Tensor | None) -> torch.Tensor | None:
    """Concatenate `x` over ranks along dim 0 in rank order; the local slice keeps its gradient.

    Other ranks' slices carry no gradient. Identity without a process group; None passes through.
    """
    if x is None or not is_dist():
        return x
    parts = _all_gather_tensor(x)
    parts[rank()] = x
    return torch.cat(parts, dim=0)


def replicated(x: torch.Tensor) -> torch.Tensor:
    """For a tensor every rank uses in full in the global loss (the logit scale): same value, its
    gradient divided by world_size, so that `loss * world_size` + DDP averaging counts it once."""
    if not is_dist() or not torch.is_tensor(x) or not x.requires_grad:
        return x
    return x.detach() + (x - x.detach()) / world_size()



def all_gather_object(obj: Any) -> list[Any]:
    """One picklable object per rank, in rank order (`[obj]` without a process group)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_list(items: list | tuple | None) -> list | None:
    """Concatenate per-rank lists (ids, texts) in rank order, matching `gather_features`' order."""
    if items is None or not is_dist():
        return None if items is None else list(items)
    out: list = []
    for part in all_gather_object(list(items)):
        out.extend(part)
    return out


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a (detached) tensor over ranks; a copy of `x` without a process group."""
    y = x.detach().clone()
    if is_dist():
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y


def global_mean(local_sum: torch.Tensor, local_count: torch.Tensor | float) -> torch.Tensor:
    """Mean over all ranks' elements whose value is the global mean on every rank and whose
    gradient w.r.t. local inputs is that of the global mean (other ranks enter as constants)."""
    # a Python count becomes a device tensor by a fill, not a host-to-device copy (a sync on CUDA)
    count = (local_count.to(local_sum.device, local_sum.dtype) if torch.is_tensor(local_count)
             else local_sum.new_full((), float(local_count)))
    if not is_dist():
        return local_sum / count.clamp_min(1e-12)
    total = all_reduce_sum(torch.stack([local_sum.detach(), count.detach()]))
    others = total[0] - local_sum.detach()
    return (local_sum + others) / total[1].clamp_min(1e-12)
