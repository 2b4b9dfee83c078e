"""AdamW with selective weight decay and layer-wise LR decay; staged training; warm-up + cosine.

Parameter groups
- No weight decay on biases, norms and every other parameter with ndim < 2, nor on positional
  embeddings, class/register/mask tokens and the logit scale (matched by name).
- Layer-wise LR decay (LLRD): a parameter of layer id l gets lr * llrd ** (top - l), top = the
  heads' id. The layer list is the model's: `param_layers()` (name -> id, ids 0 .. num_layers()-1,
  from each tower's timm-style `group_matcher()`, as PatchIBStudent does); the parameters at the top
  id are the heads (projections, mask head, local alignment, logit scale): lr * head_lr_mult, and
  the same list decides what the staged training freezes (everything below the top).

Staged training: for the first `freeze_steps` optimizer steps the towers are frozen
(`freeze_towers(model, True)`, or `apply_stage(model, step, cfg)` each step) and the head groups
run at `frozen_head_lr_mult` times their LR; tower groups then warm up from 0 at `freeze_steps`.
With DDP either wrap the model with find_unused_parameters=True or re-wrap it at the stage change:
DDP only synchronises parameters that required grad when it was built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cxrdr.common.yamlio import check_known_fields, validate_fields

NO_DECAY_NAME_PATTERNS = (
    "pos_embed", "position_embedding", "positional_embedding", "position_embeddings",
    "cls_token", "reg_token", "mask_token", "dist_token", "logit_scale", "token_type_embeddings",
    "relative_position_bias_table",
)

OPTIM_RANGES = {"lr": "(0, inf)", "weight_decay": "[0, inf)", "eps": "(0, inf)", "llrd": "(0, 1]",
                "head_lr_mult": "(0, inf)", "warmup_steps": "[0, inf)", "min_lr_ratio": "[0, 1]",
                "freeze_steps": "[0, inf)", "frozen_head_lr_mult": "(0, inf)"}


@dataclass
class OptimConfig:
    """Optimiser and schedule settings (YAML `optim:` section)."""

    lr: float = 5e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    llrd: float = 0.85  # 1.0 disables layer-wise decay
    head_lr_mult: float = 1.0
    warmup_steps: int | None = None  # None: 5% of the run's steps, at most 100 (TrainConfig.resolve)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of each group's LR
    freeze_steps: int = 0  # staged training: towers frozen for these first steps
    frozen_head_lr_mult: float = 10.0  # head LR factor while towers are frozen (on top of head_lr_mult)

    def __post_init__(self) -> None:
        validate_fields(self, "optim option", OPTIM_RANGES)
        self.betas = tuple(float(b) for b in self.betas)  # YAML gives lists
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 < self.llrd <= 1:
            raise ValueError(f"optim.llrd must be in (0, 1], got {self.llrd}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "OptimConfig":
        data = dict(data or {})
        check_known_fields(cls, data, "optim option")
        return cls(**data)


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norms, scalars and (by name) positional embeddings, special tokens, logit scale."""
    return param.ndim < 2 or name.endswith(".bias") or any(p in name for p in NO_DECAY_NAME_PATTERNS)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int, set[str]]:
    """(layer id per parameter name, top id, names of head parameters); LLRD scale = llrd ** (top - id).
    One list for LLRD and freezing: the heads are the parameters at the top id."""
    model = _unwrap(model)
    ids = model.param_layers()
    top = int(model.num_layers()) - 1
    return ids, top, {name for name, layer in ids.items() if layer == top}


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """AdamW groups keyed by (layer id, decay, head); each carries lr, lr_scale, is_head, names."""
    model = _unwrap(model)
    ids, top, heads = layer_ids(model)
    groups: dict[tuple, dict] = {}
    for name, param in model.named_parameters():
        layer = ids[name]
        is_head = name in heads
        scale = cfg.llrd ** (top - layer) * (cfg.head_lr_mult if is_head else 1.0)
        decay = not no_weight_decay(name, param)
        key = (layer, decay, is_head)
        if key not in groups:
            groups[key] = {
                "params": [], "names": [], "layer_id": layer, "is_head": is_head, "lr_scale": scale,
                "lr": cfg.lr * scale, "weight_decay": cfg.weight_decay if decay else 0.0,
            }
        groups[key]["params"].append(param)
        groups[key]["names"].append(name)
    return [groups[k] for k in sorted(groups)]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over all parameters (frozen ones included, so unfreezing later needs no rebuild)."""
    kwargs: dict[str, Any] = {}
    if any(p.is_cuda for p in model.parameters()):
        kwargs["fused"] = True
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **kwargs)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float = 0.0, start: int = 0) -> float:
    """LR factor: 0 before `start`; linear warm-up (step - start + 1) / warmup; then cosine from 1
    to min_ratio over the remaining steps up to `total`."""
    s = step - start
    if s < 0:
        return 0.0
    if s < warmup:
        return (s + 1) / warmup
    span = max(1, total - start - warmup)
    progress = min(max((s - warmup) / span, 0.0), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-group LambdaLR (call `.step()` once per optimiser step). Heads: warm-up + cosine over
    all steps, times frozen_head_lr_mult while step < freeze_steps. Towers: 0 while frozen, then
    their own warm-up from freeze_steps and cosine to total_steps."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")

    def head_factor(step: int) -> float:
        f = warmup_cosine(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
        return f * (cfg.frozen_head_lr_mult if step < cfg.freeze_steps else 1.0)

    def tower_factor(step: int) -> float:
        return warmup_cosine(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio, start=cfg.freeze_steps)

    lambdas = [head_factor if g.get("is_head", False) else tower_factor for g in opt.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(opt, lambdas)


def freeze_towers(model: nn.Module, frozen: bool) -> int:
    """Set requires_grad=False (frozen) / True on the tower (non-head) parameters. Returns how many
    parameter tensors were changed."""
    model = _unwrap(model)
    _, _, heads = layer_ids(model)
    changed = 0
    for name, param in model.named_parameters():
        if name in heads:
            continue
        if param.requires_grad == frozen:
            param.requires_grad_(not frozen)
            changed += 1
    return changed


def apply_stage(model: nn.Module, step: int, cfg: OptimConfig) -> str:
    """Freeze/unfreeze the towers for `step` (stage 'frozen' while step < freeze_steps, else 'full')."""
    frozen = step < cfg.freeze_steps
    target = _unwrap(model)
    if getattr(target, "_towers_frozen", None) is not frozen:  # act only at a stage change
        freeze_towers(target, frozen)
        target._towers_frozen = frozen
    return "frozen" if frozen else "full"


def describe_groups(opt: torch.optim.Optimizer) -> list[dict]:
    """A loggable summary: per group layer id, head flag, lr, weight decay, tensor count."""
    return [
        {"layer_id": g.get("layer_id"), "is_head": g.get("is_head"), "lr": g["lr"],
         "weight_decay": g["weight_decay"], "n_params": len(g["params"])}
        for g in opt.param_groups
    ]
