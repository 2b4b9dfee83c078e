"""AdamW with selective weight decay and layer-wise LR decay; staged training; warm-up + cosine.

Parameter groups
- No weight decay on biases, norms and every other parameter with ndim < 2, nor on positional
  embeddings, class/register/mask tokens and the logit scale (matched by name).
- Layer-wise LR decay (LLRD): a parameter of layer id l gets lr * llrd ** (top - l), top = the
  heads' id. Layer ids come from the model's `layer_id_for(name)` / `num_layers()` when it has
  them (ids 0 .. num_layers()-1, heads at num_layers()-1; towers aligned at the top, as
  PatchIBStudent does) and heads from `tower_parameters()`; otherwise from names (below).
- Heads (projections, mask head, local alignment, logit scale) get lr * head_lr_mult.
Name-based fallback: a top-level module holding numbered blocks (`blocks.N`, `layer.N`,
`layers.N`, `resblocks.N`, `stages.N`) is a tower with its own depth D; its block N has layer
id N + 1, its embeddings (patch/pos/word embeddings, cls token) id 0, its other parameters
(final norm) id D without the head multiplier. Towers of different depth are mapped onto a
common scale (id * num_layers / D). Everything outside the towers is a head (id num_layers + 1).

Staged training: for the first `freeze_steps` optimizer steps the towers are frozen
(`freeze_towers(model, True)`, or `apply_stage(model, step, cfg)` each step) and the head groups
run at `frozen_head_lr_mult` times their LR; tower groups then warm up from 0 at `freeze_steps`.
With DDP either wrap the model with find_unused_parameters=True or re-wrap it at the stage change:
DDP only synchronises parameters that required grad when it was built.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

NO_DECAY_NAME_PATTERNS = (
    "pos_embed", "position_embedding", "positional_embedding", "position_embeddings",
    "cls_token", "reg_token", "mask_token", "dist_token", "logit_scale", "token_type_embeddings",
    "relative_position_bias_table",
)
_BLOCK_RE = re.compile(r"(?:^|\.)(?:blocks|layers?|resblocks|stages)\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)(patch_embed|pos_embed|cls_token|reg_token|embeddings|token_embedding|"
                       r"positional_embedding|word_embeddings|stem|conv1|class_embedding)(?:\.|$)")


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
        from cxrdr.common.yamlio import validate_fields

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
        from cxrdr.common.yamlio import check_known_fields

        data = dict(data or {})
        check_known_fields(cls, data, "optim option")
        return cls(**data)


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norms, scalars and (by name) positional embeddings, special tokens, logit scale."""
    return param.ndim < 2 or name.endswith(".bias") or any(p in name for p in NO_DECAY_NAME_PATTERNS)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def _name_based_layers(model: nn.Module) -> tuple[dict[str, int], int]:
    """(layer id per parameter name, common num_layers) from parameter names (see module doc)."""
    names = [n for n, _ in model.named_parameters()]
    depth: dict[str, int] = {}
    for n in names:
        m = _BLOCK_RE.search(n)
        if m:
            tower = n.split(".")[0]
            depth[tower] = max(depth.get(tower, 0), int(m.group(1)) + 1)
    num_layers = max(depth.values(), default=0)
    ids: dict[str, int] = {}
    for n in names:
        tower = n.split(".")[0]
        if tower not in depth:
            ids[n] = num_layers + 1  # head
            continue
        d = depth[tower]
        m = _BLOCK_RE.search(n)
        if m:
            ids[n] = int(round((int(m.group(1)) + 1) * num_layers / d))
        elif _EMBED_RE.search(n):
            ids[n] = 0
        else:
            ids[n] = num_layers  # tower's final norm etc.: as its last block, no head multiplier
    return ids, num_layers


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int, set[str]]:
    """(layer id per parameter name, top id, names of head parameters); LLRD scale = llrd ** (top - id).

    With the model's `layer_id_for(name)` / `num_layers()` (ids 0 .. num_layers()-1, heads at the
    last id, as train.models.PatchIBStudent does), top = num_layers() - 1 and the heads are the
    parameters outside `model.tower_parameters()` when the model has it, else those at the top id.
    """
    model = _unwrap(model)
    named = list(model.named_parameters())
    if hasattr(model, "layer_id_for") and hasattr(model, "num_layers"):
        top = int(model.num_layers()) - 1
        ids = {n: min(max(int(model.layer_id_for(n)), 0), top) for n, _ in named}
        if hasattr(model, "tower_parameters"):
            tower = {id(p) for p in model.tower_parameters()}
            heads = {n for n, p in named if id(p) not in tower}
        else:
            heads = {n for n, i in ids.items() if i >= top}
    else:
        ids, num_layers = _name_based_layers(model)
        top = num_layers + 1
        heads = {n for n, i in ids.items() if i >= top}
    return ids, top, heads


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
