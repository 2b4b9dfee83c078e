"""Reading an experiment recipe: the YAML file (or a shipped recipe by name), its keys checked and ``${NAME}``
expanded, and the folder it writes under. No torch and no training config here: the lease script asks a recipe
for its folder (scripts/device_lease.sh) in a second, where importing the training side takes ~2 s.
``cxrdr.experiments.recipe`` turns a recipe into the training config of every run.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from cxrdr.common.configs import find_config
from cxrdr.common.yamlio import read_yaml_mapping

TOP_KEYS = {"name", "out", "threads", "device", "shards", "train", "eval", "efficiency", "ablation",
            "reuse_runs", "isolated_efficiency", "teachers", "reinforcement", "report", "selection",
            "resume_runs", "extends"}


def load_recipe(path: str | Path) -> dict:
    """A recipe file, or a shipped recipe by name (``cpu-demo``; `cxrdr.common.configs.find_config`). A recipe that
    ``extends: BASE`` (a file or shipped name) is BASE with its own keys laid over (``overlay``); its name is its
    own file's unless it sets one (and so its folder, ``recipe_out``), and ``_extends`` lists the files it was made
    from. Why: a probe of a recipe's settings on val reuses the recipe's shards and teachers (their folders are the
    recipe's keys) and differs from it in a few keys, which a copy of the file would let drift apart."""
    data = _read_with_bases(find_config(path, "experiments"), ())
    path = Path(data["_path"])
    if "shards" not in data or not isinstance(data["shards"], dict) or "dir" not in data["shards"]:
        raise ValueError(f"{path}: 'shards: {{dir: ...}}' is required (folder to reuse or build)")
    data.setdefault("name", path.stem)
    return expand_env(data)


def _read_with_bases(path: Path, seen: tuple[str, ...]) -> dict:
    data = read_yaml_mapping(path, "experiment keys (name, shards, train, eval, efficiency, ablation)")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown experiment key(s) {unknown}; known: {sorted(TOP_KEYS)}")
    base_name = data.pop("extends", None)
    if base_name is not None:
        base_path = find_config(base_name, "experiments")
        if str(base_path.resolve()) in seen + (str(path.resolve()),):
            raise ValueError(f"{path}: 'extends: {base_name}' comes back to a recipe it extends")
        base = _read_with_bases(base_path, seen + (str(path.resolve()),))
        for own in ("name", "out"):  # a recipe's name and folder are its own (its file's stem by default)
            base.pop(own, None)
        extends = [str(base_path), *base.pop("_extends", [])]
        data = overlay(base, data)
        data["_extends"] = extends
    data["_path"] = str(path)
    return data


def overlay(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` laid over: mappings merge key by key, a null removes the key, anything else
    (lists included) replaces the base's value. Neither argument is changed."""
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = overlay(out[key], value)
        else:
            out[key] = value
    return out


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
