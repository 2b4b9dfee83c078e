"""``ckpt:PATH``: a trained student is a teacher (a checkpoint written by ``train run``).

Used for fine-tuned teachers and self-distillation. Stage 1 finds this loader without importing
stage 2: it is the ``ckpt`` entry point of the ``cxrdr.teachers`` group (pyproject.toml), which
the teacher registry (``cxrdr.teachers``) consults. The student normalises and repeats grayscale to RGB itself, so this teacher hands it the raw
(B, 1, S, S) [0, 1] images: ``prepare_images`` is overridden and mean/std are recorded as identity.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cxrdr.teachers.base import Teacher, TeacherError, file_safe_name, weights_fingerprint
from cxrdr.train.checkpoint import load_checkpoint

CLIP_SCALE_MAX = 100.0


@dataclass
class CheckpointTeacher(Teacher):
    model: Any = field(default=None, repr=False)

    def prepare_images(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(self.device, non_blocking=True).float()  # the student normalises itself

    def _encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images)

    def _encode_texts(self, texts: list[str]) -> torch.Tensor:
        tokens = self.model.tokenize(texts)
        # the tokenizer's packing index where it gives one (the text tower then skips the padding); passed only then,
        # as a model whose tokenizer gives none need not take the argument
        packing = {"token_index": tokens["token_index"]} if "token_index" in tokens else {}
        return self.model.encode_text(tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device),
                                      **packing)


def _logit_scale(model) -> float:
    """The student's temperature as a CLIP logit scale (stored as log, capped at 100 as in CLIP)."""
    return float(model.logit_scale.detach().float().exp().clamp(max=CLIP_SCALE_MAX).item())


def load_ckpt_teacher(arg: str, spec: str, device: str = "cpu", model_cache: str | None = None,
                      options: dict | None = None) -> CheckpointTeacher:
    """The teacher loader of ``ckpt:PATH`` (signature of every loader in ``cxrdr.teachers``)."""
    options = options or {}
    path = Path(arg).expanduser()
    if not path.is_file():
        raise TeacherError(f"teacher {spec!r}: checkpoint file not found: {path}")
    try:
        model = load_checkpoint(str(path), device=device)
    except Exception as err:  # any failure to rebuild it: one line naming the spec and the file
        first = (str(err).strip().splitlines() or [""])[0]
        raise TeacherError(f"teacher {spec!r}: cannot load checkpoint {path}: {type(err).__name__}: {first}") from err
    model.eval().requires_grad_(False)
    variant = model.config.variant
    return CheckpointTeacher(
        name="ckpt-" + file_safe_name(path.stem), spec=spec, kind="clip", embed_dim=int(model.embed_dim),
        logit_scale=_logit_scale(model),
        context_length=int(options.get("context_length") or model.context_length),
        fingerprint=weights_fingerprint(model), image_size=int(model.image_size),
        mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), device=str(device),
        notes={"checkpoint": str(path.resolve()), "normalises_internally": True,
               "variant": variant},
        model=model)
