"""Experiment recipes: loading, validation and the training config of every run.

The recipe YAML names the shards (reused when ``dataset.json`` exists, built otherwise), the shared
training config (``cxrdr.train.config.TrainConfig`` fields), per-experiment and per-run overrides and
the evaluation options; see configs/experiments/cpu-demo.yaml for every key, documented. A recipe
is a path or the name of a shipped one (``cpu-demo``, also from an installed wheel).
"""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import torch

from cxrdr.common.configs import config_root, find_config
from cxrdr.common.yamlio import read_yaml_mapping
from cxrdr.train.config import TrainConfig

TOP_KEYS = {"name", "out", "threads", "device", "shards", "train", "eval", "efficiency", "ablation",
            "reuse_runs", "isolated_efficiency", "teachers", "reinforcement", "report", "selection",
            "resume_runs"}
# TrainConfig dict fields that later layers update key by key instead of replacing
MERGED_KEYS = ("model_overrides", "optim", "loss")


def load_recipe(path: str | Path) -> dict:
    """A recipe file, or a shipped recipe by name (``cpu-demo``; `cxrdr.common.configs.find_config`)."""
    path = find_config(path, "experiments")
    data = read_yaml_mapping(path, "experiment keys (name, shards, train, eval, efficiency, ablation)")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown experiment key(s) {unknown}; known: {sorted(TOP_KEYS)}")
    if "shards" not in data or not isinstance(data["shards"], dict) or "dir" not in data["shards"]:
        raise ValueError(f"{path}: 'shards: {{dir: ...}}' is required (folder to reuse or build)")
    data.setdefault("name", path.stem)
    data["_path"] = str(path)
    return expand_env(data)


def recipe_out(recipe: dict) -> Path:
    """The folder a recipe's experiments write under (``out``, default runs/experiments/<name>): each experiment in
    its own subfolder (``train experiment``), and the lease script gathers from it (scripts/device_lease.sh)."""
    return Path(recipe.get("out", f"runs/experiments/{recipe['name']}"))


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value):
    """``${NAME}`` / ``${NAME:-default}`` in every string of a recipe, from the environment (data paths that
    differ between machines, e.g. ``${CXRDR_SHARED_DATA:-../shared/data}``); an unset name without default
    is an error naming it."""
    if isinstance(value, dict):
        return {k: expand_env(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match):
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ValueError(f"recipe names ${{{name}}} but the environment does not set it")
        return default

    return _ENV.sub(sub, value)


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
