"""Where cxrdr's shipped YAML lives: model configs, experiment recipes, study overlays, prompts.

Every lookup of a shipped config goes through this module. The folder (``configs/`` layout:
``models/``, ``experiments/``, ``studies/``, ``prompts.yaml``) is, first found:

1. ``$CXRDR_CONFIGS`` (an override folder of the same layout; ``$CXRDR_MODEL_CONFIGS`` still
   replaces ``models/`` alone);
2. ``cxrdr/_configs`` inside the installed package: a wheel ships the checkout's ``configs/`` there
   as package data (pyproject.toml maps it; new YAML files are picked up by glob);
3. the checkout's top-level ``configs/`` (source tree, editable install, ``PYTHONPATH``).
"""
from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

PACKAGED = "_configs"  # the folder name of configs/ inside the installed cxrdr package
KINDS = ("models", "experiments", "studies")


def config_root() -> Path:
    """The configs folder in use (see the module docstring for the order)."""
    override = os.environ.get("CXRDR_CONFIGS")
    if override:
        return Path(override)
    packaged = files("cxrdr").joinpath(PACKAGED)
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "configs"


def config_dir(kind: str) -> Path:
    """``models``, ``experiments`` or ``studies`` folder (``$CXRDR_MODEL_CONFIGS`` for models)."""
    if kind not in KINDS:
        raise ValueError(f"unknown config kind {kind!r}; known: {', '.join(KINDS)}")
    if kind == "models" and os.environ.get("CXRDR_MODEL_CONFIGS"):
        return Path(os.environ["CXRDR_MODEL_CONFIGS"])
    return config_root() / kind


def prompts_file() -> Path:
    return config_root() / "prompts.yaml"


def available(kind: str) -> list[str]:
    """Names of the YAML files under a kind's folder (nested: ``localisation/aligned``), sorted."""
    folder = config_dir(kind)
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


def find_config(path_or_name: str | os.PathLike, kind: str) -> Path:
    """An existing file as it is; else a ``configs/...`` path read from the shipped folder (so the
    README's commands work from an installed wheel); else a name in the kind's folder (``cpu-demo``,
    ``localisation/aligned``, with or without ``.yaml``). FileNotFoundError naming what was tried."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    candidates = []
    if not path.is_absolute() and path.parts[:1] == ("configs",):
        candidates.append(config_root().joinpath(*path.parts[1:]))
    name = path.as_posix()
    candidates.append(config_dir(kind) / (name if name.endswith((".yaml", ".yml")) else name + ".yaml"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{path_or_name}: no such file, and not a {kind} config in {config_dir(kind)} "
                            f"({', '.join(available(kind)) or 'none'})")
