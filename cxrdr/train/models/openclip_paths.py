"""Exports that travel: open_clip ``local-dir:`` models whose tower paths resolve against their folder.

open_clip reads ``open_clip_config.json`` of a ``local-dir:DIR`` model and hands the tower names in it
(``vision_cfg.timm_model_name: local-dir:DIR/vision``, ``text_cfg.hf_model_name: DIR/text``) to timm and
transformers as they are: absolute paths break when DIR moves, relative ones resolve against the
working directory. A ``train export`` writes both: ``model_cfg`` keeps the absolute paths of the place it
was written (open_clip alone loads it there), and ``cxrdr_relative_paths`` names the same files relative
to DIR. Importing ``cxrdr.train.models`` (which an export's README asks for anyway when its image tower
is cxrdr's own) wraps ``open_clip.create_model`` so that a ``local-dir:`` model carrying that key gets its
towers from the folder it is loaded from, wherever the folder is now. Nothing else changes: models
without the key, other schemas and callers passing their own ``vision_cfg``/``text_cfg`` are untouched.
"""
from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path

KEY = "cxrdr_relative_paths"
LOCAL_DIR = "local-dir:"
CONFIG_NAME = "open_clip_config.json"


def relative_paths(vision: str = "vision", text: str = "text") -> dict:
    """The ``cxrdr_relative_paths`` entry of an export: tower fields relative to the export folder."""
    return {"vision_cfg": {"timm_model_name": f"{LOCAL_DIR}{vision}"},
            "text_cfg": {"hf_model_name": text, "hf_tokenizer_name": text}}


def resolve_towers(folder: str | Path, config: dict) -> dict:
    """``{tower: its model_cfg entry with the relative fields made absolute against folder}`` for the
    towers named under ``cxrdr_relative_paths`` ({} when the config has none)."""
    relative = config.get(KEY) if isinstance(config, dict) else None
    if not isinstance(relative, dict):
        return {}
    folder = Path(folder).expanduser().resolve()
    model_cfg = config.get("model_cfg") or {}
    towers = {}
    for tower, fields in relative.items():
        cfg = dict(model_cfg.get(tower) or {})
        for field, value in fields.items():
            prefix = LOCAL_DIR if value.startswith(LOCAL_DIR) else ""
            cfg[field] = prefix + str(folder / value[len(prefix):])
        towers[tower] = cfg
    return towers


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # open_clip itself reports a missing or broken config


def _resolving(create_model):
    signature = inspect.signature(create_model)

    @functools.wraps(create_model)
    def create_model_resolving_paths(model_name, *args, **kwargs):
        if isinstance(model_name, str) and model_name.startswith(LOCAL_DIR):
            folder = Path(model_name[len(LOCAL_DIR):])
            towers = resolve_towers(folder, _read_config(folder))
            if towers:
                bound = signature.bind_partial(model_name, *args, **kwargs).arguments
                # open_clip applies these to model_cfg's towers, which the towers passed here replace
                forced = {"vision_cfg": {"patch_dropout": bound.get("force_patch_dropout"),
                                         "image_size": bound.get("force_image_size")},
                          "text_cfg": {"context_length": bound.get("force_context_length")}}
                for tower, cfg in towers.items():
                    if tower in kwargs:  # the caller's own tower config wins
                        continue
                    cfg.update({k: v for k, v in forced.get(tower, {}).items() if v is not None})
                    kwargs[tower] = cfg
        return create_model(model_name, *args, **kwargs)

    create_model_resolving_paths.resolves_relative_paths = True
    return create_model_resolving_paths


def install() -> None:
    """Wrap ``open_clip.create_model`` (once); create_model_and_transforms, create_model_from_pretrained
    and open_clip_train call it through ``open_clip.factory``."""
    import open_clip
    import open_clip.factory as factory

    original = factory.create_model
    if getattr(original, "resolves_relative_paths", False):
        return
    wrapped = _resolving(original)
    factory.create_model = wrapped
    if getattr(open_clip, "create_model", None) is original:
        open_clip.create_model = wrapped
