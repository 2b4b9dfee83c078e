"""Replayable augmentations: sample K parameter sets per image once, replay them anywhere.

Parameters are plain JSON numbers, stored in each sample's metadata. ``replay(image, params,
size)`` is the single function both stages call: the teacher in ``reinforce build`` and the
student in ``train run`` therefore see pixel-identical crops at the same size. It is the one-view
case of ``replay_batch``, which a build with ``--replay device`` runs on many images' views at once
on the teacher's GPU: there the crops equal replay's within 1/255 per pixel (float rounding of
another device; a pixel lying on a posterize/solarize step may land on its other side).

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


def check_params(params) -> dict:
    """``params`` unchanged when replay can read it (the layout in this module's docstring); else a
    ValueError saying what is wrong. The training loaders replay a batch's views together in their
    collate, after each sample's own checks: this is the part of replay that reads one sample's
    parameters, run where a damaged sample can still be named and skipped."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(params, dict):
        raise ValueError(f"augmentation parameters must be an object, got {type(params).__name__}")
    crop = params.get("crop")
    if not (isinstance(crop, (list, tuple)) and len(crop) == 4 and all(map(number, crop))):
        raise ValueError(f"augmentation parameters: crop must be 4 numbers [x0, y0, w, h], got {crop!r}")
    for key in ("angle", "brightness", "contrast", "gamma"):
        if key in params and not number(params[key]):
            raise ValueError(f"augmentation parameters: {key} must be a number, got {params[key]!r}")
    if "noise_seed" in params and not (number(params["noise_seed"]) and float(params["noise_seed"]).is_integer()):
        raise ValueError(f"augmentation parameters: noise_seed must be an integer, got {params['noise_seed']!r}")
    for op in params.get("ops") or []:
        if not (isinstance(op, (list, tuple)) and len(op) == 2 and op[0] in RANDAUGMENT_OPS and number(op[1])):
            raise ValueError(f"augmentation parameters: an op must be [name, magnitude] with a name of "
                             f"{', '.join(RANDAUGMENT_OPS)}, got {op!r}")
    return params


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
    one-view case of :func:`replay_batch`, so a view replayed alone or among others is the same bits.
    """
    return replay_many(image, [params], size)[0]


def replay_many(image, params_list: list[dict], size: int) -> torch.Tensor:
    """Replay several parameter sets on one image: (K, 1, size, size) float32 in [0, 1].

    :func:`replay_batch` of one image: the image is converted and pooled once for all its views.
    """
    if size < 1:
        raise ValueError(f"replay size must be >= 1 pixel, got {size}")
    if not params_list:
        return torch.empty(0, 1, size, size)
    return replay_batch(to_float_image(image).unsqueeze(0), None, params_list, [0] * len(params_list), size)


def replay_each(images: list, params_list: list[dict], size: int) -> torch.Tensor:
    """One view of each image, ``params_list[i]`` on ``images[i]`` (PIL, array or float tensor):
    (n, 1, size, size), bit for bit ``torch.stack([replay(im, p, size) ...])``.

    A training batch's views replayed together (the collate calls this): the images of one size go
    through :func:`replay_batch` at once, which needs no padding for them and so does the per-sample
    arithmetic; an image of another size is its own group. On the demo's batch of 32 stored 128-px
    phantoms at 96 px: 4.4 ms against 13.3 ms one view at a time (``benchmarks/data_path.py``)."""
    if size < 1:
        raise ValueError(f"replay size must be >= 1 pixel, got {size}")
    pixels = [to_float_image(image) for image in images]
    out = torch.empty(len(pixels), 1, size, size)
    groups: dict[tuple, list[int]] = {}
    for i, image in enumerate(pixels):
        groups.setdefault(tuple(image.shape), []).append(i)
    for members in groups.values():
        stacked = torch.stack([pixels[i] for i in members])
        out[members] = replay_batch(stacked, None, [params_list[i] for i in members], list(range(len(members))),
                                    size)
    return out


def replay_batch(images: torch.Tensor, image_sizes, params_list: list[dict], owners: list[int],
                 size: int) -> torch.Tensor:
    """Replay views of several images at once, on the images' device: (n, 1, size, size) float32 in [0, 1].

    ``images``: (B, 1, H, W) float in [0, 1], image ``i`` in its top-left ``image_sizes[i]`` = (w, h)
    pixels and zero beyond (None: every image fills H x W); view ``j`` replays ``params_list[j]`` on
    image ``owners[j]``. This is the one implementation of replay: :func:`replay` and
    :func:`replay_many` call it with one image, so the build's batched (GPU) replay does the same
    arithmetic as the per-sample CPU replay of stage 2 (within float rounding on another device or
    canvas size: the contract is 1/255 per pixel, tested).

    Each view: crop + rotation + flip as one affine sampling grid (:func:`view_to_image`, float64)
    read by bilinear ``grid_sample`` from the image box-filtered by an integer factor first
    (anti-aliasing strong down-sampling; the grid is in the pooled image's pixel units), then the
    photometric ops. Images are pooled once per factor, the grids of all views computed together,
    and each photometric step runs on all the views it applies to at once; a view's value never
    depends on the other views (reductions are per view, in the same order whatever the batch).
    """
    out = torch.empty(len(params_list), 1, size, size, device=images.device)
    groups: dict[int, list[int]] = {}
    for j, params in enumerate(params_list):
        _, _, w, h = params["crop"]
        k = int(min(w, h) / size / 1.5)
        groups.setdefault(k if k >= 2 else 1, []).append(j)
    for k, members in groups.items():
        pooled = F.avg_pool2d(images, kernel_size=k, stride=k) if k >= 2 else images
        if image_sizes is not None and k >= 2:
            pooled = pooled * _inside(image_sizes, k, pooled.shape[-2:], images.device)
        _, _, ph, pw = pooled.shape
        grid = _grids([params_list[j] for j in members], k, pw, ph, size, images.device)
        out[torch.tensor(members, device=images.device)] = _sample(pooled, grid, [owners[j] for j in members])
    return _photometric(out, params_list).clamp_(0.0, 1.0)


def _sample(images: torch.Tensor, grid: torch.Tensor, owners: list[int]) -> torch.Tensor:
    """Bilinear reads of views (grids (m, S, S, 2), view ``r`` of image ``owners[r]``): (m, 1, S, S).

    One ``grid_sample`` reads every image once, with no copy of it per view: image i's views are
    stacked along its grid's rows (its s-th view at rows s*S..), and an image with fewer views than
    the most gets grid points outside every image (zero-padded reads, dropped)."""
    n_images, size = images.shape[0], grid.shape[1]
    count: dict[int, int] = {}
    slot = []
    for owner in owners:
        slot.append(count.get(owner, 0))
        count[owner] = slot[-1] + 1
    per_image = max(count.values())
    rows = [owner * per_image + s for owner, s in zip(owners, slot)]
    stacked = rows == list(range(n_images * per_image))  # as laid out already (one image: always)
    if not stacked:
        full = grid.new_full((n_images * per_image, size, size, 2), -4.0)
        full[torch.tensor(rows, device=grid.device)] = grid
        grid = full
    sampled = F.grid_sample(images, grid.view(n_images, per_image * size, size, 2), mode="bilinear",
                            padding_mode="zeros", align_corners=False).view(-1, 1, size, size)
    return sampled if stacked else sampled[torch.tensor(rows, device=grid.device)]


def _inside(image_sizes, k: int, shape, device) -> torch.Tensor:
    """(B, 1, ph, pw) 1/0 mask of the pooled cells that lie wholly inside each image: pooling a canvas
    makes edge cells that average an image's last pixels with the padding; pooling the image alone
    (what replay does) has no such cells, so zero-padded sampling reads zeros there."""
    rows = torch.arange(shape[0], device=device).view(1, 1, -1, 1)
    cols = torch.arange(shape[1], device=device).view(1, 1, 1, -1)
    w = torch.tensor([s[0] // k for s in image_sizes], device=device).view(-1, 1, 1, 1)
    h = torch.tensor([s[1] // k for s in image_sizes], device=device).view(-1, 1, 1, 1)
    return ((rows < h) & (cols < w)).float()


_UV_CACHE: dict[int, torch.Tensor] = {}


def _output_uv(size: int) -> torch.Tensor:
    """Output pixel centres along one axis in view coordinates, (size,) float64 (rows and columns alike)."""
    uv = _UV_CACHE.get(size)
    if uv is None:
        uv = _UV_CACHE[size] = (torch.arange(size, dtype=torch.float64) + 0.5) / size * 2 - 1
    return uv


def _grids(params_list: list[dict], k: int, pw: int, ph: int, size: int, device) -> torch.Tensor:
    """grid_sample grids (n, size, size, 2) of several views: :func:`view_to_image` vectorised over views.

    The output grid is separable (u depends on the column only, v on the row only), so every
    product is taken on (n, size) vectors and only the final sums and the pixel -> grid scaling
    touch (n, size, size); each value is the same float64 expression as in :func:`view_to_image`.
    """
    crop = torch.tensor([p["crop"] for p in params_list], dtype=torch.float64, device=device)
    w, h = crop[:, 2:3], crop[:, 3:4]
    cx, cy = crop[:, 0:1] + w / 2, crop[:, 1:2] + h / 2
    radians = [math.radians(p.get("angle", 0.0)) for p in params_list]
    # math, not torch: the libm values view_to_image uses
    cos = torch.tensor([math.cos(a) for a in radians], dtype=torch.float64, device=device)[:, None]
    sin = torch.tensor([math.sin(a) for a in radians], dtype=torch.float64, device=device)[:, None]
    steps = _output_uv(size).to(device)
    flip = torch.tensor([bool(p.get("hflip")) for p in params_list], device=device)[:, None]
    u = torch.where(flip, -steps, steps)  # (n, size): u of every column
    v = steps[None, :]  # (1, size): v of every row
    dx, dy = u * w / 2, v * h / 2  # (n, size): dx per column, dy per row
    grid = torch.empty(len(params_list), size, size, 2, device=device)
    for axis, col_term, row_term, scale in ((0, cx + dx * cos, dy * sin, pw), (1, cy - dx * sin, dy * cos, ph)):
        xy = col_term[:, None, :] + row_term[:, :, None]  # (n, row, col), as c + dx*. + dy*. in view_to_image
        xy /= k
        xy *= 2
        xy /= scale
        xy -= 1
        grid[..., axis] = xy
    return grid


def _column(values, device) -> torch.Tensor:
    """Per-view float32 factors shaped (n, 1, 1, 1): each rounds to float32 as a Python scalar operand
    would, so a batched product has the bits of the one-view product."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1, 1, 1)


def _where(flags: list[bool], x: torch.Tensor, fn) -> None:
    """Apply ``fn(selected views, their indices)`` to the views with a true flag, in place in ``x``."""
    chosen = [i for i, flag in enumerate(flags) if flag]
    if chosen:
        index = torch.tensor(chosen, device=x.device)
        x.index_copy_(0, index, fn(x.index_select(0, index), chosen))


def _photometric(x: torch.Tensor, params_list: list[dict]) -> torch.Tensor:
    """Brightness, contrast, gamma, then the RandAugment-style ops of each view, on (n, 1, S, S).

    A step that leaves a view unchanged (contrast or gamma 1) is not applied to it at all, and each
    op position runs once per op name on the views that have that op there."""
    get = lambda key, default: [float(p.get(key, default)) for p in params_list]  # noqa: E731
    contrast, gamma = get("contrast", 1.0), get("gamma", 1.0)
    x = x * _column(get("brightness", 1.0), x.device)

    def stretch(v, chosen):
        mean = _means(v)
        return v.sub_(mean).mul_(_column([contrast[i] for i in chosen], v.device)).add_(mean)

    _where([c != 1.0 for c in contrast], x, stretch)
    x = x.clamp_(0.0, 1.0)
    _where([g != 1.0 for g in gamma], x, lambda v, chosen: v.pow_(_column([gamma[i] for i in chosen], v.device)))
    ops = [p.get("ops", []) for p in params_list]
    for position in range(max(map(len, ops), default=0)):
        for name in sorted({o[position][0] for o in ops if position < len(o)}):
            _where([position < len(o) and o[position][0] == name for o in ops], x, lambda v, chosen: _apply_op(
                v, name, [float(ops[i][position][1]) / 10.0 for i in chosen],
                [params_list[i].get("noise_seed", 0) for i in chosen]))
    return x


def _means(x: torch.Tensor) -> torch.Tensor:
    """Per-view mean (n, 1, 1, 1), each view summed whole on one thread, whatever n and torch's threads:
    torch splits a reduction to one value across threads (its bits then depend on their number) but
    reduces each of several values on one thread, so a single view is reduced as one of two."""
    if x.shape[0] == 1:
        return x.expand(2, -1, -1, -1).mean(dim=(1, 2, 3), keepdim=True)[:1]
    return x.mean(dim=(1, 2, 3), keepdim=True)


def _blur(x: torch.Tensor) -> torch.Tensor:
    kernel = torch.tensor([1.0, 2.0, 1.0], device=x.device)
    kernel = (kernel[:, None] * kernel[None, :]) / 16.0
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), kernel.view(1, 1, 3, 3))


def _apply_op(x: torch.Tensor, name: str, m: list[float], noise_seeds: list[int]) -> torch.Tensor:
    """One op on views (n, 1, S, S), view ``i`` at magnitude ``m[i]`` in 0..1."""
    mt = _column(m, x.device)
    if name == "autocontrast":
        lo, hi = x.amin(dim=(1, 2, 3), keepdim=True), x.amax(dim=(1, 2, 3), keepdim=True)
        stretched = (x - lo) / (hi - lo).clamp_min(1e-6)
        return x + mt * (stretched - x)
    if name == "sharpness":
        return (x + mt * (x - _blur(x))).clamp(0, 1)
    if name == "posterize":
        steps = _column([2 ** max(2, int(round(8 - 4 * v))) - 1 for v in m], x.device)
        return torch.floor(x * steps + 0.5) / steps
    if name == "solarize":
        return torch.where(x >= _column([1.0 - 0.5 * v for v in m], x.device), 1.0 - x, x)
    if name == "blur":
        return x + mt * (_blur(x) - x)
    if name == "noise":
        # Drawn on the CPU from the view's own seed: the same numbers whichever device replays.
        noise = torch.stack([torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(int(seed)))
                             for seed in noise_seeds]).to(x.device)
        return (x + noise * 0.05 * mt).clamp(0, 1)
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
