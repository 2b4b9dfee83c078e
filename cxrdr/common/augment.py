"""Replayable augmentations: sample K parameter sets per image once, replay them anywhere.

Parameters are plain JSON numbers, stored in each sample's metadata. ``replay(image, params,
size)`` is the single function both stages call: the teacher in ``reinforce build`` and the
student in ``train run`` therefore see pixel-identical crops at the same size.

Geometry is expressed in stored-image pixels and applied as one affine resampling
(``torch.nn.functional.grid_sample``) from the output grid into the image. That makes the
result independent of the output size (replaying at 224 and at 112 shows the same region)
and needs no intermediate crops. We write this rather than use torchvision's v2 transforms
because those sample their own randomness: here the randomness is sampled once, stored,
and replayed exactly.

Params layout (all JSON-serialisable):
    {"crop": [x0, y0, w, h],     # box in stored-image pixels (float)
     "angle": deg,                # rotation about the crop centre, counter-clockwise
     "hflip": false,              # off by default: laterality carries meaning in CXR
     "brightness": b, "contrast": c, "gamma": g,
     "ops": [[name, magnitude], ...],   # optional RandAugment-style photometric ops, magnitude 0..10
     "noise_seed": int}           # seeds the "noise" op so it replays exactly
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

RANDAUGMENT_OPS = ("autocontrast", "sharpness", "posterize", "solarize", "blur", "noise")


@dataclass
class AugConfig:
    scale: tuple[float, float] = (0.6, 1.0)  # crop area as a fraction of the image
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # crop aspect ratio w/h
    max_angle: float = 7.0  # degrees, uniform in [-max, max]
    brightness: float = 0.15  # factor uniform in [1-b, 1+b]
    contrast: float = 0.15
    gamma: tuple[float, float] = (0.85, 1.18)
    randaugment_n: int = 0  # ops per set (0 = off)
    randaugment_magnitude: float = 5.0  # 0..10
    hflip: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "AugConfig":
        data = dict(data)
        for key in ("scale", "ratio", "gamma"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


def stable_seed(*parts) -> int:
    """A 63-bit seed from any printable parts, stable across processes and Python versions."""
    digest = hashlib.sha1("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_params(rng: np.random.Generator, width: int, height: int, cfg: AugConfig) -> dict:
    """One augmentation parameter set for an image of ``width`` x ``height`` stored pixels."""
    x0, y0, w, h = _sample_crop(rng, width, height, cfg.scale, cfg.ratio)
    params = {
        "crop": [round(x0, 3), round(y0, 3), round(w, 3), round(h, 3)],
        "angle": round(float(rng.uniform(-cfg.max_angle, cfg.max_angle)), 3),
        "hflip": bool(cfg.hflip and rng.random() < 0.5),
        "brightness": round(float(rng.uniform(1 - cfg.brightness, 1 + cfg.brightness)), 4),
        "contrast": round(float(rng.uniform(1 - cfg.contrast, 1 + cfg.contrast)), 4),
        "gamma": round(float(math.exp(rng.uniform(*np.log(cfg.gamma)))), 4),
        "ops": [],
        "noise_seed": int(rng.integers(0, 2**31 - 1)),
    }
    for _ in range(cfg.randaugment_n):
        name = RANDAUGMENT_OPS[int(rng.integers(len(RANDAUGMENT_OPS)))]
        magnitude = float(np.clip(rng.normal(cfg.randaugment_magnitude, 1.0), 0, 10))
        params["ops"].append([name, round(magnitude, 3)])
    return params


def sample_param_sets(record_key: str, width: int, height: int, k: int, cfg: AugConfig,
                      seed: int = 0) -> list[dict]:
    """K parameter sets for one record, deterministic in (seed, record_key)."""
    rng = np.random.default_rng(stable_seed("aug", seed, record_key))
    return [sample_params(rng, width, height, cfg) for _ in range(k)]


def full_image_params(width: int, height: int) -> dict:
    """The identity view: the whole stored image, no photometric change (for evaluation)."""
    return {"crop": [0.0, 0.0, float(width), float(height)], "angle": 0.0, "hflip": False,
            "brightness": 1.0, "contrast": 1.0, "gamma": 1.0, "ops": [], "noise_seed": 0}


def _sample_crop(rng, width, height, scale, ratio):
    """RandomResizedCrop's box sampling (Szegedy et al.), in continuous pixel units."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = math.sqrt(target * aspect)
        h = math.sqrt(target / aspect)
        if 0 < w <= width and 0 < h <= height:
            return float(rng.uniform(0, width - w)), float(rng.uniform(0, height - h)), w, h
    # Fallback: the largest centred box whose ratio is within range.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, width / ratio[0]
    elif in_ratio > ratio[1]:
        w, h = height * ratio[1], height
    else:
        w, h = width, height
    return (width - w) / 2, (height - h) / 2, float(w), float(h)


def to_float_image(image) -> torch.Tensor:
    """PIL 'L' image, HxW uint8 array or tensor -> float32 tensor (1, H, W) in [0, 1]."""
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("L"))
    if isinstance(image, np.ndarray):
        if not image.flags.writeable:
            image = np.array(image)  # PIL's asarray is read-only; torch warns on those
        tensor = torch.from_numpy(np.ascontiguousarray(image))
    else:
        tensor = image
    if tensor.dtype == torch.uint8:
        tensor = tensor.float() / 255.0
    tensor = tensor.float()
    if tensor.ndim == 2:
        tensor = tensor.unsqueeze(0)
    return tensor[:1]


def view_to_image(params: dict, uv: np.ndarray) -> np.ndarray:
    """Map view coordinates (u, v in [-1, 1], (N, 2)) to stored-image pixel coordinates (N, 2)."""
    x0, y0, w, h = params["crop"]
    uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2).copy()
    if params.get("hflip"):
        uv[:, 0] = -uv[:, 0]
    a = math.radians(params.get("angle", 0.0))
    dx, dy = uv[:, 0] * w / 2, uv[:, 1] * h / 2
    cx, cy = x0 + w / 2, y0 + h / 2
    # Image y grows downwards, so a counter-clockwise rotation on screen uses -a here.
    x = cx + dx * math.cos(a) + dy * math.sin(a)
    y = cy - dx * math.sin(a) + dy * math.cos(a)
    return np.stack([x, y], axis=1)


def image_to_view(params: dict, xy: np.ndarray) -> np.ndarray:
    """Inverse of :func:`view_to_image`: stored-image pixels (N, 2) -> view coords in [-1, 1]."""
    x0, y0, w, h = params["crop"]
    xy = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
    a = math.radians(params.get("angle", 0.0))
    px, py = xy[:, 0] - (x0 + w / 2), xy[:, 1] - (y0 + h / 2)
    dx = px * math.cos(a) - py * math.sin(a)
    dy = px * math.sin(a) + py * math.cos(a)
    uv = np.stack([dx / (w / 2), dy / (h / 2)], axis=1)
    if params.get("hflip"):
        uv[:, 0] = -uv[:, 0]
    return uv


def replay(image, params: dict, size: int) -> torch.Tensor:
    """Apply one stored parameter set: float32 tensor (1, size, size) in [0, 1].

    Pure and deterministic: the same (image, params, size) always gives the same tensor. The
    one-view case of :func:`replay_many`, so a view replayed alone or among others is the same bits.
    """
    return replay_many(image, [params], size)[0]


def replay_many(image, params_list: list[dict], size: int) -> torch.Tensor:
    """Replay several parameter sets on one image: (K, 1, size, size) float32 in [0, 1].

    Each view: crop + rotation + flip as one affine sampling grid (:func:`view_to_image`, float64)
    read by bilinear ``grid_sample`` from the image box-filtered by an integer factor first
    (anti-aliasing strong down-sampling; the grid is in the pooled image's pixel units), then the
    photometric ops. Work shared by the views is done once: the image is converted and pooled
    once per factor, the grids computed in one numpy pass and resampled by one batched
    ``grid_sample``; the photometric ops (whose ``mean`` is a reduction) run one view at a time,
    so a view's bits do not depend on the other views.
    """
    if size < 1:
        raise ValueError(f"replay size must be >= 1 pixel, got {size}")
    if not params_list:
        return torch.empty(0, 1, size, size)
    src = to_float_image(image)
    uv = _output_uv(size)
    out = torch.empty(len(params_list), 1, size, size)
    groups: dict[int, list[int]] = {}
    for i, params in enumerate(params_list):
        _, _, w, h = params["crop"]
        k = int(min(w, h) / size / 1.5)
        groups.setdefault(k if k >= 2 else 1, []).append(i)
    for k, members in groups.items():
        pooled = F.avg_pool2d(src.unsqueeze(0), kernel_size=k, stride=k).squeeze(0) if k >= 2 else src
        _, ph, pw = pooled.shape
        grid = _grids([params_list[i] for i in members], uv, k, pw, ph, size)
        batch = pooled.unsqueeze(0).expand(len(members), -1, -1, -1)
        sampled = F.grid_sample(batch, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        for j, i in enumerate(members):
            out[i] = _photometric(sampled[j], params_list[i]).clamp_(0.0, 1.0)
    return out


_UV_CACHE: dict[int, np.ndarray] = {}


def _output_uv(size: int) -> np.ndarray:
    """Output pixel centres in view coordinates, (size*size, 2) float64, as :func:`replay` makes them."""
    uv = _UV_CACHE.get(size)
    if uv is None:
        steps = (torch.arange(size, dtype=torch.float64) + 0.5) / size * 2 - 1
        vv, uu = torch.meshgrid(steps, steps, indexing="ij")
        uv = torch.stack([uu.reshape(-1), vv.reshape(-1)], dim=1).numpy()
        uv.setflags(write=False)
        _UV_CACHE[size] = uv
    return uv


def _grids(params_list: list[dict], uv: np.ndarray, k: int, pw: int, ph: int, size: int) -> torch.Tensor:
    """grid_sample grids (n, size, size, 2) of several views: :func:`view_to_image` vectorised over views.

    The output grid is separable (u depends on the column only, v on the row only), so every
    product is taken on (n, size) vectors and only the final sums and the pixel -> grid scaling
    touch (n, size, size); each value is still the same float64 expression as in :func:`replay`.
    """
    n = len(params_list)
    crop = np.array([p["crop"] for p in params_list], dtype=np.float64)
    w, h = crop[:, 2:3], crop[:, 3:4]
    cx, cy = crop[:, 0:1] + w / 2, crop[:, 1:2] + h / 2
    radians = [math.radians(p.get("angle", 0.0)) for p in params_list]
    cos = np.array([math.cos(a) for a in radians])[:, None]  # math, not np: the same libm values as replay
    sin = np.array([math.sin(a) for a in radians])[:, None]
    u = np.broadcast_to(uv[:size, 0], (n, size)).copy()  # uv rows 0..size-1: v fixed, u = every column
    v = uv[::size, 1][None, :]  # every size-th row: u fixed, v = every row
    flip = np.array([bool(p.get("hflip")) for p in params_list])
    u[flip] = -u[flip]
    dx, dy = u * w / 2, v * h / 2  # (n, size): dx per column, dy per row
    grid = np.empty((n, size, size, 2), dtype=np.float64)
    for axis, col_term, row_term, scale in ((0, cx + dx * cos, dy * sin, pw), (1, cy - dx * sin, dy * cos, ph)):
        xy = col_term[:, None, :] + row_term[:, :, None]  # (n, row, col), as c + dx*. + dy*. in replay
        xy /= k
        xy *= 2
        xy /= scale
        xy -= 1
        grid[..., axis] = xy
    return torch.from_numpy(grid).float()


def _photometric(x: torch.Tensor, params: dict) -> torch.Tensor:
    """Brightness, contrast, gamma, then the RandAugment-style ops (in place after the first product)."""
    x = x * params.get("brightness", 1.0)
    contrast = params.get("contrast", 1.0)
    if contrast != 1.0:
        mean = x.mean()
        x = x.sub_(mean).mul_(contrast).add_(mean)
    x = x.clamp_(0.0, 1.0)
    gamma = params.get("gamma", 1.0)
    if gamma != 1.0:
        x = x.pow_(gamma)
    for name, magnitude in params.get("ops", []):
        x = _apply_op(x, name, float(magnitude), params.get("noise_seed", 0))
    return x


def _blur(x: torch.Tensor) -> torch.Tensor:
    kernel = torch.tensor([1.0, 2.0, 1.0])
    kernel = (kernel[:, None] * kernel[None, :]) / 16.0
    padded = F.pad(x.unsqueeze(0), (1, 1, 1, 1), mode="replicate")
    return F.conv2d(padded, kernel.view(1, 1, 3, 3)).squeeze(0)


def _apply_op(x: torch.Tensor, name: str, magnitude: float, noise_seed: int) -> torch.Tensor:
    m = magnitude / 10.0
    if name == "autocontrast":
        lo, hi = x.min(), x.max()
        stretched = (x - lo) / (hi - lo).clamp_min(1e-6)
        return x + m * (stretched - x)
    if name == "sharpness":
        return (x + m * (x - _blur(x))).clamp(0, 1)
    if name == "posterize":
        levels = 2 ** max(2, int(round(8 - 4 * m)))
        return torch.floor(x * (levels - 1) + 0.5) / (levels - 1)
    if name == "solarize":
        threshold = 1.0 - 0.5 * m
        return torch.where(x >= threshold, 1.0 - x, x)
    if name == "blur":
        return x + m * (_blur(x) - x)
    if name == "noise":
        gen = torch.Generator().manual_seed(int(noise_seed))
        return (x + torch.randn(x.shape, generator=gen) * 0.05 * m).clamp(0, 1)
    raise ValueError(f"unknown augmentation op {name!r}; known: {', '.join(RANDAUGMENT_OPS)}")


def resize_short_side(image: Image.Image, short_side: int) -> Image.Image:
    """Resize keeping the aspect ratio so the short side is ``short_side`` pixels."""
    w, h = image.size
    scale = short_side / min(w, h)
    if scale == 1:
        return image
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    resample = Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC
    return image.resize(size, resample)
