"""Reading the training step's numbers without stalling the GPU.

Reading a CUDA tensor on the host (``.item()``, ``float()``, ``bool()``, an ``if`` on a tensor) waits
for every kernel queued before it, so the step would run in lock-step with Python. The loop keeps its
loss terms, gradient norm and finiteness on the device, and reads them here, in one transfer, on
logging and saving steps only.
"""
from __future__ import annotations

import torch


def read_scalars(values: dict) -> dict[str, float]:
    """{name: float} of a dict of 0-d tensors (and Python numbers), read in one device-to-host copy."""
    tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
    out = {k: float(v) for k, v in values.items() if not torch.is_tensor(v)}
    if tensors:
        stacked = torch.stack([v.detach().float().reshape(()) for v in tensors.values()]).tolist()
        out.update(zip(tensors, stacked))
    return out


class FiniteWatch:
    """Remembers, on the device, the first step whose total loss was not finite and its terms.

    ``observe`` costs two small kernels and no sync; ``check`` reads one number and raises
    FloatingPointError naming that step and its terms. The trainer checks on logging and saving steps
    (exact there: no checkpoint holds weights after a non-finite loss), so a NaN is reported at most
    ``log_every`` steps late, and its step is the one it happened at.
    """

    def __init__(self):
        self.first_step: torch.Tensor | None = None  # long, -1 while every loss was finite
        self.terms: torch.Tensor | None = None  # the terms of that step (float32)
        self.names: list[str] = []

    def observe(self, terms: dict[str, torch.Tensor], step: int) -> None:
        stacked = torch.stack([t.detach().float().reshape(()) for t in terms.values()])
        if self.first_step is None or list(terms) != self.names:  # first step, or other terms (rare)
            self.check()  # a bad step recorded under the old names is reported with them
            self.names = list(terms)
            self.first_step = torch.full((), -1, dtype=torch.long, device=stacked.device)
            self.terms = torch.zeros_like(stacked)
        first_bad = ~torch.isfinite(terms["total"].detach()) & (self.first_step < 0)
        self.first_step = torch.where(first_bad, step, self.first_step)
        self.terms = torch.where(first_bad, stacked, self.terms)

    def check(self) -> None:
        if self.first_step is None:
            return
        step = int(self.first_step)
        if step >= 0:
            values = dict(zip(self.names, self.terms.tolist()))
            raise FloatingPointError(f"non-finite loss at step {step}: {values}")
