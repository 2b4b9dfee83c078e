"""CLIP InfoNCE with pair selection (targets.py), Robinson hard negatives, and the text memory bank.

- Logits = logit_scale * img @ txt.T on L2-normalised embeddings (logit_scale already exp'd).
- Hard negatives (Robinson et al., ICLR 2021): for anchor i with negatives N_i (entries with zero
  target), the denominator's negative sum  sum_j e^{s_ij}  becomes the importance-weighted
  |N_i| * sum_j w_ij e^{s_ij},  w_ij = softmax_j(beta * s_ij) over N_i (weights detached: they act
  as a sampling distribution). beta = 0 gives plain InfoNCE; `beta_schedule` ramps beta.
- Memory bank (`TextQueue`): past text embeddings appended as extra i2t negatives.
Inputs are the *global* batch: the objective gathers features across ranks once before calling these.
"""
from __future__ import annotations

import torch
from torch import nn

from cxrdr.train.losses.config import FN_MODES
from cxrdr.train.losses.precision import full_precision
from cxrdr.train.losses.targets import target_matrix


def soft_ce_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row -sum_j t_ij log softmax(logits)_ij; entries with zero target contribute nothing
    (so -inf logits there are safe)."""
    logp = torch.log_softmax(logits, dim=1)
    logp = torch.where(targets > 0, logp, torch.zeros_like(logp))
    return -(targets * logp).sum(dim=1)


def beta_schedule(step: int, total: int, beta_min: float, beta_max: float) -> float:
    """Hard-negative curriculum: beta rises linearly from beta_min (step 0) to beta_max (step total)."""
    if total <= 0:
        return float(beta_max)
    frac = min(max(step / total, 0.0), 1.0)
    return float(beta_min + (beta_max - beta_min) * frac)


def _direction_loss(logits: torch.Tensor, targets: torch.Tensor, exclude: torch.Tensor | None,
                    beta: float) -> torch.Tensor:
    """Mean over anchors of the soft-target InfoNCE of one direction, with optional exclusions
    (dropped from the denominator) and Robinson hard-negative reweighting of zero-target entries."""
    if exclude is not None:
        logits = logits.masked_fill(exclude, float("-inf"))
        targets = targets.masked_fill(exclude, 0.0)
        targets = targets / targets.sum(dim=1, keepdim=True).clamp_min(1e-12)
    if beta != 0.0:
        neg = targets == 0
        if exclude is not None:
            neg = neg & ~exclude
        n_neg = neg.sum(dim=1, keepdim=True)
        has_neg = n_neg > 0
        weights_in = (beta * logits.detach()).masked_fill(~neg, float("-inf"))
        weights_in = torch.where(has_neg, weights_in, torch.zeros_like(weights_in))
        log_w = torch.log_softmax(weights_in, dim=1)  # log w_ij over N_i
        adjust = torch.log(n_neg.clamp_min(1).to(logits.dtype)) + log_w
        logits = torch.where(neg, logits + adjust, logits)
    return soft_ce_rows(logits, targets).mean()


def _with_extra(logits, targets, exclude, extra_logits):
    """i2t logits/targets/exclusions widened by the memory bank's columns (zero targets)."""
    n, q = logits.shape[0], extra_logits.shape[1]
    logits = torch.cat([logits, extra_logits], dim=1)
    targets = torch.cat([targets, targets.new_zeros(n, q)], dim=1)
    if exclude is not None:
        exclude = torch.cat([exclude, exclude.new_zeros(n, q)], dim=1)
    return logits, targets, exclude


@full_precision
def clip_loss(
    img: torch.Tensor,
    txt: torch.Tensor,
    logit_scale: torch.Tensor | float,
    w_i2t: float = 0.5,
    w_t2i: float = 0.5,
    positives: torch.Tensor | None = None,
    beta: float = 0.0,
    soft_targets: torch.Tensor | None = None,
    fn_mode: str = "multi",
    extra_txt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Symmetric InfoNCE  w_i2t * L_i2t + w_t2i * L_t2i  with the pair selection of targets.py.

    img, txt: (B, D) normalised; positives: (B, B) bool; soft_targets: (B, B) row-stochastic;
    extra_txt: (Q, D) extra i2t negatives (memory bank).
    """
    if fn_mode not in FN_MODES:
        raise ValueError(f"fn_mode must be one of {FN_MODES}, got {fn_mode!r}")
    if img.shape != txt.shape:
        raise ValueError(f"clip_loss: image {tuple(img.shape)} and text {tuple(txt.shape)} embeddings differ in shape")
    img, txt = img.float(), txt.float()
    scale = torch.as_tensor(logit_scale, device=img.device).float()
    logits = scale * img @ txt.T
    targets, exclude = target_matrix(img.shape[0], positives, soft_targets, fn_mode, img.device, img.dtype)

    loss = img.new_zeros(())
    if w_i2t:
        i2t = (logits, targets, exclude)
        if extra_txt is not None and extra_txt.shape[0] > 0:
            i2t = _with_extra(*i2t, scale * img @ extra_txt.to(img.device, img.dtype).T)
        loss = loss + w_i2t * _direction_loss(*i2t, beta)
    if w_t2i:
        loss = loss + w_t2i * _direction_loss(logits.T, targets, None if exclude is None else exclude.T, beta)
    return loss


class ClipLoss(nn.Module):
    """`clip_loss` with the weights and pair-selection mode of a LossConfig bound (cf. open_clip's ClipLoss)."""

    def __init__(self, w_i2t: float = 0.5, w_t2i: float = 0.5, fn_mode: str = "multi"):
        super().__init__()
        self.w_i2t, self.w_t2i, self.fn_mode = w_i2t, w_t2i, fn_mode

    def forward(self, img, txt, logit_scale, positives=None, soft_targets=None, beta: float = 0.0,
                extra_txt=None) -> torch.Tensor:
        return clip_loss(img, txt, logit_scale, self.w_i2t, self.w_t2i, positives=positives, beta=beta,
                         soft_targets=soft_targets, fn_mode=self.fn_mode, extra_txt=extra_txt)


class TextQueue:
    """FIFO memory bank of past (detached) text embeddings used as extra i2t negatives (MoCo-style).

    Under DDP enqueue the *gathered* texts so every rank holds the same queue.
    """

    def __init__(self, size: int, dim: int, device: torch.device | str = "cpu"):
        if size <= 0 or dim <= 0:
            raise ValueError(f"TextQueue needs size > 0 and dim > 0, got size={size}, dim={dim}")
        self.size, self.dim = size, dim
        self.buffer = torch.zeros(size, dim, device=device)
        self.ptr = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def get(self) -> torch.Tensor | None:
        """A copy of the stored embeddings (n, dim), or None while empty. A copy: the loss that uses
        them is backpropagated after `enqueue` has overwritten the buffer in place."""
        return None if self.count == 0 else self.buffer[: self.count].clone()

    @torch.no_grad()
    def enqueue(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"TextQueue.enqueue: expected (n, {self.dim}), got {tuple(x.shape)}")
        x = x.detach().to(self.buffer.device, self.buffer.dtype)[-self.size:]
        n = x.shape[0]
        idx = (self.ptr + torch.arange(n, device=self.buffer.device)) % self.size
        self.buffer[idx] = x
        self.ptr = (self.ptr + n) % self.size
        self.count = min(self.count + n, self.size)

    def to(self, device: torch.device | str) -> "TextQueue":
        self.buffer = self.buffer.to(device)
        return self

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.cpu(), "ptr": self.ptr, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["buffer"].shape) != (self.size, self.dim):
            raise ValueError(f"TextQueue state has shape {tuple(state['buffer'].shape)}, "
                             f"expected {(self.size, self.dim)}")
        self.buffer = state["buffer"].to(self.buffer.device, self.buffer.dtype)
        self.ptr, self.count = int(state["ptr"]), int(state["count"])
