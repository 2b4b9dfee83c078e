"""Experiment recipes: the training config of every run (reading the file: ``recipe_file``).

The recipe YAML names the shards (reused when ``dataset.json`` exists, built otherwise), the shared
training config (``cxrdr.train.config.TrainConfig`` fields), per-experiment and per-run overrides and
the evaluation options; see configs/experiments/cpu-demo.yaml for every key, documented. A recipe
is a path or the name of a shipped one (``cpu-demo``, also from an installed wheel).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from cxrdr.common.configs import config_root
from cxrdr.train.config import TrainConfig

# TrainConfig dict fields that later layers update key by key instead of replacing
MERGED_KEYS = ("model_overrides", "optim", "loss")


def train_config(recipe: dict, shards: Path, run_dir: Path, overrides: dict,
                 experiment: str | None = None) -> TrainConfig:
    """TrainConfig = recipe['train'] < recipe[experiment]['train'] < per-run overrides; shards/out forced."""
    data = copy.deepcopy(recipe.get("train") or {})
    experiment_train = (recipe.get(experiment) or {}).get("train") or {} if experiment else {}
    for layer in (experiment_train, overrides or {}):
        for key, value in layer.items():
            if key in MERGED_KEYS:  # a run's `loss: {w_feature: ..}` adds to the experiment's loss keys
                data.setdefault(key, {}).update(value)
            else:
                data[key] = value
    return make_train_config(recipe, {**data, "shards": str(shards), "out": str(run_dir)})


def make_train_config(recipe: dict, data: dict) -> TrainConfig:
    """The one place a recipe's training keys become a TrainConfig (the recipe's device unless given)."""
    if recipe.get("device"):
        data.setdefault("device", recipe["device"])
    prompts = data.get("eval_prompts")
    if prompts and not Path(prompts).is_file() and Path(prompts).parts[:1] == ("configs",):
        # a shipped prompt file named as from the checkout (configs/prompts-nih.yaml): the recipe then runs
        # from any folder, e.g. an empty one, not only the checkout's root; there the path stays as written
        shipped = config_root().joinpath(*Path(prompts).parts[1:])
        if shipped.is_file():
            data["eval_prompts"] = str(shipped)
    return TrainConfig.load(None, **data)


def recipe_seeds(recipe: dict, spec: dict, default: list[int] | None = None) -> list[int]:
    """``spec['seeds']``, else ``default``, else the recipe's training seed."""
    seeds = spec.get("seeds") or default or [(recipe.get("train") or {}).get("seed", 0)]
    return [int(s) for s in seeds]


def set_threads(recipe: dict) -> None:
    if recipe.get("threads"):
        torch.set_num_threads(int(recipe["threads"]))
