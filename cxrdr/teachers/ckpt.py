"""``ckpt:PATH``: a student checkpoint written by ``train run`` used as a teacher.

Used for fine-tuned teachers and self-distillation. Loading goes through the one public
loader ``cxrdr.train.load_checkpoint(path, device)`` (the only place ``reinforce`` imports ``train``).
The student normalises and repeats grayscale to RGB itself, so this teacher hands it the raw
(B, 1, S, S) [0, 1] images: ``prepare_images`` is overridden and mean/std are recorded as identity.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .base import Teacher, TeacherError, file_safe_name, weights_fingerprint

CLIP_SCALE_MAX = 100.0


@dataclass
class CheckpointTeacher(Teacher):
    model: Any = field(default=None, repr=False)

    def prepare_images(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(self.device, non_blocking=True).float()  # the student normalises itself

    def _encode_images(self, images: torch.Tensor) -> torch.Tensor:
        if hasattr(self.model, "encode_image"):
            return self.model.encode_image(images)
        return self.model.embed_images(images)

    def _encode_texts(self, texts: list[str]) -> torch.Tensor:
        if hasattr(self.model, "tokenize") and hasattr(self.model, "encode_text"):
            tokens = self.model.tokenize(texts)
            return self.model.encode_text(tokens["input_ids"].to(self.device),
                                          tokens["attention_mask"].to(self.device))
        return self.model.embed_texts(texts)


def _loader():
    try:
        from cxrdr.train.checkpoint import load_checkpoint
    except ImportError as err:
        raise TeacherError(f"ckpt: teachers need the cxrdr train package: {err}") from err
    return load_checkpoint


def _logit_scale(model) -> float:
    scale = getattr(model, "logit_scale", None)
    if scale is None:
        return CLIP_SCALE_MAX
    value = torch.as_tensor(scale).detach().float()
    return float(value.exp().clamp(max=CLIP_SCALE_MAX).item())


def load_ckpt_teacher(arg: str, spec: str, device: str = "cpu", model_cache: str | None = None,
                      options: dict | None = None) -> CheckpointTeacher:
    options = options or {}
    path = Path(arg).expanduser()
    if not path.is_file():
        raise TeacherError(f"teacher {spec!r}: checkpoint file not found: {path}")
    load_checkpoint = _loader()
    try:
        model = load_checkpoint(str(path), device=device)
    except TeacherError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise TeacherError(f"teacher {spec!r}: cannot load checkpoint {path}: {type(err).__name__}: {first}") from err
    model.eval().requires_grad_(False)
    config = getattr(model, "config", None)
    variant = getattr(config, "variant", None) if config is not None else None
    teacher = CheckpointTeacher(
        name="ckpt-" + file_safe_name(path.stem), spec=spec, kind="clip", embed_dim=int(model.embed_dim),
        logit_scale=_logit_scale(model),
        context_length=int(options.get("context_length") or getattr(model, "context_length", 77)),
        fingerprint=weights_fingerprint(model), image_size=int(model.image_size),
        mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), device=str(device),
        notes={"checkpoint": str(path.resolve()), "normalises_internally": True,
               **({"variant": variant} if variant else {})},
        model=model)
    return teacher
