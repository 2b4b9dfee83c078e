"""``random:tiny``: a seeded, randomly initialised tiny open_clip CLIP, for tests and benchmarks.

Built in code (no files, no network): ViT image tower at 64 px (patch 16, width 64, 2 layers),
a 2-layer text transformer with open_clip's SimpleTokenizer (its BPE vocab ships with
open_clip), 64-d joint space. Its embeddings mean nothing; dataset.json labels it
``test_only`` so nobody mistakes a build made with it for a real one.
"""
from __future__ import annotations

import functools

import torch

from .base import TeacherError
from .openclip import OpenClipTeacher, _seeded, teacher_from_model

# context 32: captions fit; long reports are truncated, acceptable for a test-only teacher, and text is
# then about as cheap as an image (17 tokens).
TINY = dict(embed_dim=64, image_size=64, patch_size=16, width=64, layers=2, heads=2, context_length=32)
SEED = 0


def build_tiny_clip(seed: int = SEED):
    """(model, tokenizer) of the tiny CLIP; identical weights for the same seed and torch version."""
    import open_clip
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg
    from open_clip.transform import PreprocessCfg

    vision = CLIPVisionCfg(layers=TINY["layers"], width=TINY["width"], head_width=TINY["width"] // TINY["heads"],
                           patch_size=TINY["patch_size"], image_size=TINY["image_size"])
    text = CLIPTextCfg(context_length=TINY["context_length"], width=TINY["width"], heads=TINY["heads"],
                       layers=TINY["layers"])
    with _seeded(seed):
        model = open_clip.CLIP(embed_dim=TINY["embed_dim"], vision_cfg=vision, text_cfg=text)
    open_clip.set_model_preprocess_cfg(model, PreprocessCfg(size=TINY["image_size"]).__dict__)
    return model, _tokenizer()


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """open_clip's SimpleTokenizer at the tiny context: one a process (reading its BPE merges takes ~0.13 s, and the
    tests build this teacher dozens of times); it keeps no state but its cache of encoded words."""
    import open_clip

    return open_clip.SimpleTokenizer(context_length=TINY["context_length"])


def load_random_teacher(arg: str, spec: str, device: str = "cpu", model_cache: str | None = None,
                        options: dict | None = None) -> OpenClipTeacher:
    if arg != "tiny":
        raise TeacherError(f"unknown random teacher {spec!r}; the only one is random:tiny")
    model, tokenizer = build_tiny_clip()
    model.to(device)
    return teacher_from_model(model, tokenizer, name="random-tiny", spec=spec, device=device,
                              notes={"test_only": True, "seed": SEED, "arch": dict(TINY)},
                              options=options or {})
