"""What every teacher provides, whatever model sits behind it."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


CUDA_DTYPE = torch.bfloat16  # the teachers' autocast dtype on CUDA


class TeacherError(ValueError):
    """A teacher spec that cannot be loaded (bad spec, missing weights); message is one line."""


def file_safe_name(text: str) -> str:
    """Lower-case [a-z0-9_-] form of ``text`` for teacher names (they become shard extensions)."""
    name = re.sub(r"[^a-z0-9_-]+", "-", text.lower()).strip("-_")
    return name or "teacher"


@dataclass
class Teacher:
    """A frozen model that embeds images and/or texts into one L2-normalised space.

    Subclasses implement ``_encode_images`` (float (B, 3, S, S), already normalised) and
    ``_encode_texts``; this base handles grayscale->RGB, normalisation, batching, inference
    mode, CUDA autocast (bf16) and L2-normalisation so every teacher behaves the same.
    """

    name: str  # file-safe key used in shard extensions ('biomedclip', 'minilm', ...)
    spec: str  # the spec string it was loaded from
    kind: str  # 'clip' (image + text) or 'text' (text only)
    embed_dim: int
    logit_scale: float
    context_length: int
    fingerprint: str
    image_size: int | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    device: str = "cpu"
    notes: dict = field(default_factory=dict)  # e.g. {"test_only": True} for random:tiny

    @property
    def has_images(self) -> bool:
        return self.kind == "clip"

    def describe(self) -> dict:
        return {"name": self.name, "spec": self.spec, "kind": self.kind,
                "embed_dim": self.embed_dim, "logit_scale": self.logit_scale,
                "context_length": self.context_length, "fingerprint": self.fingerprint,
                "image_size": self.image_size, "mean": self.mean, "std": self.std,
                **self.notes}

    def prepare_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1, S, S) in [0, 1] at ``image_size`` -> normalised (B, 3, S, S) on device."""
        x = images.to(self.device, non_blocking=True).float()
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def encode_images(self, images: torch.Tensor, on_device: bool = False) -> torch.Tensor:
        """(B, 1, S, S) in [0, 1] -> (B, D) L2-normalised float32 on CPU (``on_device``: left on the teacher's
        device, so a caller embedding several inputs waits for the GPU once, not once per call)."""
        if not self.has_images:
            raise TypeError(f"teacher {self.spec!r} is text-only and has no image encoder")
        return self._embedded(lambda x: self._encode_images(self.prepare_images(x)), images, on_device)

    def encode_texts(self, texts: list[str], on_device: bool = False) -> torch.Tensor:
        """list of B strings -> (B, D) L2-normalised float32 on CPU (``on_device``: as ``encode_images``)."""
        return self._embedded(self._encode_texts, list(texts), on_device)

    def text_tokenizer(self):
        """A picklable ``texts -> (B, L) integer array`` that ``encode_tokens`` takes, for the build's workers to
        run (so the build's process only runs forwards), or None where the teacher tokenizes in its forward."""
        return None

    def encode_tokens(self, tokens, on_device: bool = False) -> torch.Tensor:
        """(B, L) tokens from ``text_tokenizer()`` -> (B, D) L2-normalised float32 on CPU: ``encode_texts``
        of the texts they came from, without the tokenizing (``on_device``: as ``encode_images``)."""
        return self._embedded(self._encode_tokens, torch.as_tensor(tokens), on_device)

    def _embedded(self, encode, inputs, on_device: bool = False) -> torch.Tensor:
        """``encode(inputs)`` without autograd, under the teacher's autocast: L2-normalised float32 on CPU, or on
        the teacher's device (``on_device``: no wait for the GPU here)."""
        with torch.inference_mode(), self._autocast():
            out = encode(inputs)
        out = F.normalize(out.float(), dim=-1)
        return out if on_device else out.cpu()

    def _autocast(self):
        """bf16 autocast on CUDA (fp32's exponent range, so no activation overflows, and the dtype the
        training loop runs in); fp32 on the CPU."""
        enabled = str(self.device).startswith("cuda")
        return torch.autocast(device_type="cuda", dtype=CUDA_DTYPE, enabled=enabled) if enabled \
            else torch.autocast(device_type="cpu", enabled=False)

    def _encode_images(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _encode_texts(self, texts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    def _encode_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"teacher {self.spec!r} has no text_tokenizer(): embed texts with encode_texts")


def weights_fingerprint(module: torch.nn.Module) -> str:
    """sha1 over parameter names, shapes and bytes: identifies the exact weights a teacher used."""
    digest = hashlib.sha1()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).to(torch.float32).numpy().tobytes())
    return digest.hexdigest()[:16]
