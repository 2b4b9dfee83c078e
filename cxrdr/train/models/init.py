"""Initialise a student from local weights only: an open_clip model (e.g. BiomedCLIP) or a cxrdr checkpoint.

Spec forms for ``init_from``:
- ``ckpt:PATH`` or a file PATH: a checkpoint written by ``cxrdr.train.checkpoint_io.save_checkpoint``;
  every tensor whose name and shape match is copied.
- ``DIR`` / ``local-dir:DIR``: an open_clip snapshot directory (open_clip_config.json + weights);
- ``openclip:ARCH:PATH``: an open_clip architecture with a local pretrained weight file.
open_clip tensors are mapped ``visual.trunk.* -> image tower``, ``text.transformer.* -> text tower``,
``visual.head.proj.weight -> image_proj.proj.weight`` and copied where shapes match.
"""
from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import torch
from timm.layers import resample_abs_pos_embed

from cxrdr.train.checkpoint_io import read_checkpoint

log = logging.getLogger(__name__)


def create_open_clip(spec: str):
    """(open_clip model, tokenizer) from a local spec; never touches the network.

    Cached (one entry): building one student asks for it up to three times (text tower, tokenizer,
    weights); ``build_student`` calls ``release_open_clip_cache()`` afterwards.
    """
    return _cached_open_clip(str(spec))


def release_open_clip_cache() -> None:
    _cached_open_clip.cache_clear()


@functools.lru_cache(maxsize=1)
def _cached_open_clip(spec: str):
    # imported here: only a student initialised from open_clip weights needs it, and importing it costs every
    # `train` process ~1.5 s on a 2-core box
    import open_clip

    spec = str(spec)
    if spec.startswith("openclip:"):
        parts = spec.split(":", 2)
        if len(parts) != 3 or not Path(parts[2]).expanduser().exists():
            raise ValueError(f"init_from {spec!r}: expected openclip:ARCH:LOCAL_WEIGHTS_PATH with an existing file")
        arch, weights = parts[1], str(Path(parts[2]).expanduser())
        model = open_clip.create_model(arch, pretrained=weights)
        return model, open_clip.get_tokenizer(arch)
    path = spec[len("local-dir:"):] if spec.startswith("local-dir:") else spec
    if not (Path(path) / "open_clip_config.json").is_file():
        raise ValueError(f"init_from {spec!r}: no open_clip_config.json in {path} (need a local open_clip snapshot)")
    name = f"local-dir:{path}"
    return open_clip.create_model(name), open_clip.get_tokenizer(name)


def _resample_pos_embed(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A ViT positional embedding (1, 1 + g*g, d) resized to another square grid (other image_size)."""
    if source.ndim != 3 or source.shape[-1] != target.shape[-1]:
        return source
    side = math.isqrt(target.shape[1] - 1)
    if side * side != target.shape[1] - 1:
        return source
    return resample_abs_pos_embed(source, new_size=(side, side), num_prefix_tokens=1)


def _copy_matching(target: torch.nn.Module, source: dict[str, torch.Tensor], prefix_map: dict[str, str]) -> int:
    """Copy tensors from ``source`` (renamed by prefix_map) into ``target`` where name and shape match."""
    own = target.state_dict()
    update = {}
    for name, tensor in source.items():
        for src, dst in prefix_map.items():
            if name.startswith(src):
                new = dst + name[len(src):]
                if new.endswith("trunk.pos_embed") and new in own and own[new].shape != tensor.shape:
                    tensor = _resample_pos_embed(tensor, own[new])
                if new in own and own[new].shape == tensor.shape:
                    update[new] = tensor
                break
    target.load_state_dict(update, strict=False)
    return len(update)


def initialise_student(student: torch.nn.Module, spec: str) -> dict:
    """Load local weights into ``student``; returns {'copied': n, 'total': n_student_tensors, 'source': spec}."""
    spec = str(spec)
    path = Path(spec[5:] if spec.startswith("ckpt:") else spec).expanduser()
    total = len(student.state_dict())
    if path.is_file() and not spec.startswith("openclip:"):
        state = read_checkpoint(path)["model"]
        copied = _copy_matching(student, state, {"": ""})
    else:
        model, _ = create_open_clip(spec)
        copied = _copy_matching(student, model.state_dict(), {
            "visual.trunk.": "image_tower.trunk.",
            "visual.head.proj.": "image_proj.proj.",
            "text.transformer.": "text_tower.model.",
        })
    if copied == 0:
        raise ValueError(f"init_from {spec!r}: no tensor matched the student by name and shape")
    log.info("init_from %s: copied %d of %d tensors", spec, copied, total)
    return {"copied": copied, "total": total, "source": spec}
