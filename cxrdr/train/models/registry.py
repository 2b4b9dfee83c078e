"""Image tower registry, in timm's ``register_model`` manner: each tower module registers the
creators of the towers it defines; the factory looks them up by ``StudentConfig.image_tower``.

A creator is ``create(config, load_pretrained) -> module``. ``token_sequence=True`` creators return
a timm ``VisionTransformer`` (the factory wraps it in ``ViTTower`` or, for variant E,
``TokenDroppingViT``); the others return a finished ``ImageTower``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TowerEntry:
    create: Callable
    token_sequence: bool  # a ViT token sequence: variant E and head_layer work on it


_TOWERS: dict[str, TowerEntry] = {}


def register_tower(*names: str, token_sequence: bool = False) -> Callable:
    """Decorator: register ``create(config, load_pretrained)`` under each of ``names``."""
    def decorate(create: Callable) -> Callable:
        for name in names:
            if name in _TOWERS:
                raise ValueError(f"image tower {name!r} is registered twice")
            _TOWERS[name] = TowerEntry(create, token_sequence)
        return create
    return decorate


def tower_names() -> tuple[str, ...]:
    return tuple(_TOWERS)


def token_sequence_towers() -> tuple[str, ...]:
    return tuple(name for name, entry in _TOWERS.items() if entry.token_sequence)


def tower_entry(name: str) -> TowerEntry:
    if name not in _TOWERS:
        raise ValueError(f"image_tower must be one of {tower_names()}, got {name!r}")
    return _TOWERS[name]
