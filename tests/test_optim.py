"""Optimiser groups (LLRD, selective weight decay, head LR), staged freezing, warm-up + cosine."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cxrdr.train.optim import (
    OptimConfig,
    apply_stage,
    build_optimizer,
    build_scheduler,
    freeze_towers,
    layer_ids,
    warmup_cosine,
)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)


class Tower(nn.Module):
    def __init__(self, d, depth):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, d))
        self.patch_embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)


class TinyStudent(nn.Module):
    """Names like a timm ViT image tower + a head; no layer_id_for -> name-based fallback."""

    def __init__(self, d=4, depth=3):
        super().__init__()
        self.image = Tower(d, depth)
        self.proj = nn.Linear(d, d, bias=True)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))


class StudentWithLayerIds(TinyStudent):
    """The PatchIBStudent convention: ids 0..num_layers()-1, heads at the last id, tower_parameters()."""

    def num_layers(self):
        return 4

    def layer_id_for(self, name):
        return 1 if name.startswith("image.") else 3

    def tower_parameters(self):
        return list(self.image.parameters())


def lr_of(opt, param):
    for g in opt.param_groups:
        if any(p is param for p in g["params"]):
            return g["lr"], g["weight_decay"]
    raise KeyError


def test_llrd_and_no_decay_groups():
    model = TinyStudent()
    cfg = OptimConfig(lr=1e-3, weight_decay=0.05, llrd=0.5, head_lr_mult=3.0)
    opt = build_optimizer(model, cfg)
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))
    # depth 3: block k -> layer k+1, scale 0.5 ** (4 - (k+1)); embeddings 0.5 ** 4; final norm 0.5 ** 1
    for k in range(3):
        lr, wd = lr_of(opt, model.image.blocks[k].fc.weight)
        assert lr == pytest.approx(1e-3 * 0.5 ** (3 - k)) and wd == 0.05
        lr, wd = lr_of(opt, model.image.blocks[k].fc.bias)
        assert lr == pytest.approx(1e-3 * 0.5 ** (3 - k)) and wd == 0.0
        assert lr_of(opt, model.image.blocks[k].norm.weight)[1] == 0.0
    assert lr_of(opt, model.image.pos_embed) == (pytest.approx(1e-3 * 0.5 ** 4), 0.0)
    assert lr_of(opt, model.image.patch_embed.weight) == (pytest.approx(1e-3 * 0.5 ** 4), 0.05)
    assert lr_of(opt, model.image.norm.weight) == (pytest.approx(1e-3 * 0.5), 0.0)
    # heads: full LR times the head multiplier; logit scale never decayed
    assert lr_of(opt, model.proj.weight) == (pytest.approx(3e-3), 0.05)
    assert lr_of(opt, model.proj.bias) == (pytest.approx(3e-3), 0.0)
    assert lr_of(opt, model.logit_scale) == (pytest.approx(3e-3), 0.0)


def test_model_layer_ids_are_used_when_present():
    model = StudentWithLayerIds()
    ids, top, heads = layer_ids(model)
    assert top == 3 and "proj.weight" in heads and "image.blocks.0.fc.weight" not in heads
    opt = build_optimizer(model, OptimConfig(lr=1.0, llrd=0.5, head_lr_mult=2.0))
    assert lr_of(opt, model.image.blocks[2].fc.weight)[0] == pytest.approx(0.25)  # 0.5 ** (3 - 1)
    assert lr_of(opt, model.proj.weight)[0] == pytest.approx(2.0)
    freeze_towers(model, True)
    assert not model.image.blocks[0].fc.weight.requires_grad and model.logit_scale.requires_grad


def test_warmup_cosine_values():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    model = TinyStudent()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, total_steps=14)
    head = next(g for g in opt.param_groups if g["is_head"])
    seen = []
    for _ in range(15):
        seen.append(head["lr"] / head["lr_scale"])
        opt.step()
        sched.step()
    expected = [1 / 4, 2 / 4, 3 / 4, 4 / 4]
    expected += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 10)) for s in range(4, 15)]
    assert seen == pytest.approx(expected)
    assert seen[-1] == pytest.approx(0.1) and seen[4] == pytest.approx(1.0)


def test_staged_training_freezes_towers_and_boosts_heads():
    cfg = OptimConfig(lr=1.0, warmup_steps=2, freeze_steps=3, frozen_head_lr_mult=10.0, llrd=1.0)
    model = TinyStudent()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, total_steps=20)
    tower = next(g for g in opt.param_groups if not g["is_head"])
    head = next(g for g in opt.param_groups if g["is_head"])
    stages, tower_lrs, head_lrs = [], [], []
    for step in range(6):
        stages.append(apply_stage(model, step, cfg))
        if step < 3:
            assert not model.image.blocks[0].fc.weight.requires_grad and model.proj.weight.requires_grad
        else:
            assert model.image.blocks[0].fc.weight.requires_grad
        tower_lrs.append(tower["lr"])
        head_lrs.append(head["lr"])
        opt.step()
        sched.step()
    assert stages == ["frozen"] * 3 + ["full"] * 3
    assert tower_lrs[:3] == [0.0, 0.0, 0.0] and tower_lrs[3:5] == pytest.approx([0.5, 1.0])
    assert head_lrs[:2] == pytest.approx([5.0, 10.0])  # warm-up times the frozen-stage multiplier
    assert head_lrs[3] == pytest.approx(warmup_cosine(3, 2, 20))
    assert freeze_towers(model, False) == 0  # already unfrozen


def test_optim_config_validation():
    assert OptimConfig.from_dict({"betas": [0.9, 0.95]}).betas == (0.9, 0.95)
    with pytest.raises(ValueError, match="unknown optim option"):
        OptimConfig.from_dict({"learning_rate": 1})
    with pytest.raises(ValueError, match="llrd"):
        OptimConfig(llrd=0.0)
