"""Build a student from its config: the one place that turns a StudentConfig into towers and a model.

Dependencies run one way: ``checkpoint -> factory -> student, towers, init``. Image towers come
from the tower registry (``registry.py``), filled by the tower modules imported here.
"""
from __future__ import annotations

import os
from typing import Any

from cxrdr.train.models import hybrid_tower  # noqa: F401  (registers hybrid_lite0_vit)
from cxrdr.train.models.config import StudentConfig
from cxrdr.train.models.image_towers import ImageTower, ViTTower
from cxrdr.train.models.init import initialise_student, release_open_clip_cache
from cxrdr.train.models.registry import tower_entry
from cxrdr.train.models.student import PatchIBStudent
from cxrdr.train.models.text_towers import build_text_tower, build_tokenizer
from cxrdr.train.models.token_dropping import TokenDroppingViT


def build_image_tower(config: StudentConfig, load_pretrained: bool = True) -> ImageTower:
    """The image tower of a StudentConfig (E wraps the ViT in a TokenDroppingViT).

    ``load_pretrained=False`` skips packaged ImageNet weights (a checkpoint's weights replace them anyway,
    so loading one does not need the weights package)."""
    entry = tower_entry(config.image_tower)
    if not entry.token_sequence:
        if config.use_token_dropping:
            raise ValueError(f"variant E (token dropping) is not available with {config.image_tower}; "
                             f"use a ViT tower")
        return entry.create(config, load_pretrained)
    vit = entry.create(config, load_pretrained)
    if config.use_token_dropping:
        return TokenDroppingViT(vit, drop_layer=config.drop_layer, keep_rate=config.keep_rate,
                                warmup_steps=config.keep_rate_warmup_steps, patch_score=config.patch_score,
                                fuse_dropped=config.fuse_dropped, global_pool=config.global_pool,
                                head_layer=config.head_layer)
    return ViTTower(vit, config.global_pool, config.head_layer)


def build_student(config: StudentConfig | dict | str | os.PathLike, init_weights: bool = True) -> PatchIBStudent:
    """A student from a StudentConfig, a dict of its fields, or a config name/path ('D', 'tiny-E', x.yaml).

    ``init_weights``: apply ``config.init_from`` (local open_clip model or cxrdr checkpoint) and packaged
    pretrained tower weights (efficientnet_lite0); loading a checkpoint passes False because its own
    weights replace everything anyway.
    """
    config = StudentConfig.coerce(config).replace()  # a copy: the model writes resolved fields into it
    try:
        model = PatchIBStudent(
            config, build_image_tower(config, init_weights),
            build_text_tower(config.text_tower, config.context_length, config.text_pool, config.text_kwargs,
                             config.init_from),
            build_tokenizer(config.text_tower, config.context_length, config.init_from))
        if init_weights and config.init_from:
            initialise_student(model, config.init_from)
    finally:
        release_open_clip_cache()  # do not keep a whole open_clip model alive
    return model


def create_student(name_or_config: StudentConfig | dict | str | os.PathLike, init_weights: bool = True,
                   **overrides: Any) -> PatchIBStudent:
    """``build_student`` with field overrides, timm ``create_model`` style:
    ``create_student("tiny-D", image_size=96)``."""
    if isinstance(name_or_config, StudentConfig):
        config = name_or_config.replace(**overrides)
    elif isinstance(name_or_config, dict):
        config = StudentConfig.from_dict({**name_or_config, **overrides})
    else:
        config = StudentConfig.from_yaml(name_or_config, **overrides)
    return build_student(config, init_weights=init_weights)
