"""The model under evaluation behind one interface, and its embeddings of full-image views."""
from __future__ import annotations

import collections
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from cxrdr.common import augment
from cxrdr.common.shards import Sample
from cxrdr.teachers import load_teacher
from cxrdr.train.checkpoint import load_checkpoint


@dataclass
class EvalModel:
    """One interface over a cxrdr student and a reinforce Teacher."""

    name: str
    module: object
    is_student: bool
    image_size: int
    device: torch.device

    def embed_images(self, images: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            if self.is_student:
                out = self.module.encode_image(images.to(self.device))
            else:
                out = self.module.encode_images(images)
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu().numpy()

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            if self.is_student:
                tok = self.module.tokenize(list(texts))
                out = self.module.encode_text(tok["input_ids"].to(self.device),
                                              tok["attention_mask"].to(self.device), tok.get("token_index"))
            else:
                out = self.module.encode_texts(list(texts))
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu().numpy()

    def forward(self, images: torch.Tensor, texts: list[str]):
        tok = self.module.tokenize(list(texts))
        with torch.no_grad():
            out = self.module(images.to(self.device), tok["input_ids"].to(self.device),
                              tok["attention_mask"].to(self.device), step=None)
        return out, tok


def as_eval_model(model, device: str | None = None) -> EvalModel:
    """Wrap a student / teacher, or load one from a spec or checkpoint path."""
    if isinstance(model, EvalModel):
        return model
    if isinstance(model, (str, Path)):
        spec = str(model)
        path = spec[5:] if spec.startswith("ckpt:") else spec
        if spec.startswith("ckpt:") or Path(path).suffix in (".pt", ".pth") or Path(path).is_file():
            if not Path(path).is_file():
                raise FileNotFoundError(f"checkpoint not found: {path}")
            student = load_checkpoint(path, device=device or "cpu")
            student.eval()
            return EvalModel(f"ckpt:{path}", student, True, int(student.image_size),
                             _device_of(student))
        teacher = load_teacher(spec, device=device or "cpu")
        return as_eval_model(teacher)
    if hasattr(model, "encode_images") and hasattr(model, "encode_texts"):  # a Teacher
        if not getattr(model, "has_images", True):
            raise ValueError(f"teacher {model.spec!r} is text-only: it cannot be evaluated on images")
        return EvalModel(model.spec, model, False, int(model.image_size), torch.device(model.device))
    if hasattr(model, "encode_image") and hasattr(model, "tokenize"):
        model.eval()
        name = getattr(getattr(model, "config", None), "name", "") or type(model).__name__
        return EvalModel(name, model, True, int(model.image_size), _device_of(model))
    raise TypeError(f"cannot evaluate a {type(model).__name__}: expected a student, a Teacher or a spec")


def _device_of(module) -> torch.device:
    try:
        return next(module.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def full_view(sample: Sample, size: int) -> tuple[torch.Tensor, dict]:
    image = sample.image()
    params = augment.full_image_params(*image.size)
    return augment.replay(image, params, size), params


# Full views kept for the process, up to this many MB: a recipe evaluates a dozen runs on the same images (the GPU
# recipe's 2,000 probe rows and 1,000 report images at 224 px, ~600 MB), and each evaluation decoded and replayed
# them anew on one host thread: ~1.3 ms an image on a 2-core box's core (benchmarks/evaluation_phases.py --repeat 2),
# ~3.8 s of every later evaluation of that recipe (on the H200 at 355812b its "embed_train" phase took 9.3 s).
VIEW_CACHE_MB = 1024
_VIEWS: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()


def _views_key(samples, size: int) -> tuple:
    """The images' identity: shard, key and a CRC-32 of the stored bytes (a rebuilt folder may reuse keys)."""
    return size, tuple((s.url, s.key, zlib.crc32(s.image_bytes or b"")) for s in samples)


def cached_full_views(samples, size: int, progress: bool = False, desc: str = "") -> torch.Tensor | None:
    """(N, 1, size, size) full views of ``samples`` (shard samples: their stored bytes name the images), decoded
    and replayed once per process for the same images; None when they would take more than ``VIEW_CACHE_MB``, or
    for images read from files (a benchmark's), which the caller decodes batch by batch."""
    if len(samples) * size * size * 4 > VIEW_CACHE_MB * 2**20 or not all(isinstance(s, Sample) for s in samples):
        return None
    key = _views_key(samples, size)
    if key not in _VIEWS:
        views = [full_view(s, size)[0] for s in tqdm(samples, desc=desc, disable=not progress, leave=False)]
        _VIEWS[key] = torch.stack(views) if views else torch.zeros(0, 1, size, size)
        while sum(v.numel() * 4 for v in _VIEWS.values()) > VIEW_CACHE_MB * 2**20:
            _VIEWS.popitem(last=False)  # the least recently used first
    _VIEWS.move_to_end(key)
    return _VIEWS.get(key)


def view_batches(samples, size: int, batch_size: int, progress: bool = False, desc: str = ""):
    """Batches (B, 1, size, size) of the full views of ``samples``, in order: sliced from the views kept for the
    process (``cached_full_views``), or decoded batch by batch where they are not kept."""
    samples = list(samples)
    views = cached_full_views(samples, size, progress, desc)
    if views is not None:
        yield from (views[i:i + batch_size] for i in range(0, len(views), batch_size))
        return
    batch: list[torch.Tensor] = []
    for s in tqdm(samples, desc=desc, disable=not progress, leave=False):
        batch.append(full_view(s, size)[0])
        if len(batch) == batch_size:
            yield torch.stack(batch)
            batch = []
    if batch:
        yield torch.stack(batch)


def embed_images(model: EvalModel, samples, batch_size: int, progress: bool, desc: str) -> np.ndarray:
    out = [model.embed_images(batch) for batch in view_batches(samples, model.image_size, batch_size, progress, desc)]
    return np.concatenate(out) if out else np.zeros((0, 1), np.float32)


def embed_texts(model: EvalModel, texts: list[str], batch_size: int) -> np.ndarray:
    return np.concatenate([model.embed_texts(texts[i:i + batch_size])
                           for i in range(0, len(texts), batch_size)])
