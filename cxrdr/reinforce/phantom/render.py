"""Phantom pixels: vectorised numpy drawing of a CXR-like image, and the finding boxes.

The image is composed in layers on a normalised coordinate grid (x right, y down, both in
[0, 1]; the patient's right is on the image left): air, body soft tissue, two dark lung fields
with vascular texture, mediastinum, trachea, heart, then the findings, then bones (spine,
ribs, clavicles) and devices, then exposure (brightness, contrast, gamma) and quantum noise.
Shapes are analytic soft masks (linear ramps ~1.5 px wide), so the same functions give the
pixels and, evaluated on a coarse grid, the ground-truth boxes without rendering.

Boxes: one per finding, in pixels of the rendered image, with the finding's side; a bilateral
finding (effusion, consolidation, opacity, atelectasis, edema) gets one box per lung (side
"right" on the image left, "left" on the image right), split at the midline.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

from cxrdr.common.augment import stable_seed
from cxrdr.reinforce.phantom.cases import DEVICE, SEVERITIES, THORAX_MM, Case, Finding, Geometry

ZONES = {"apex": (0.0, 0.15), "upper": (0.1, 0.38), "mid": (0.35, 0.62), "lower": (0.6, 0.85),
         "base": (0.8, 1.0)}
BOX_GRID = 128  # resolution of the masks that boxes are measured on

# Gray levels before exposure (0 black .. 1 white).
AIR, LUNG, FLUID, HEART, MEDIASTINUM = 0.02, 0.13, 0.6, 0.68, 0.64


@lru_cache(maxsize=8)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres as a (1, size) row X and a (size, 1) column Y. Numpy broadcasts them where
    both meet, so what depends on one coordinate only (a lung's lateral wall at each height, the
    ramps across the mediastinum) is computed once per row or column, not once per pixel: the
    same float32 operations per pixel, so the same pixels as on full grids, in about three quarters
    of the time (benchmarks/phantom_render.py)."""
    c = (np.arange(size, dtype=np.float32) + 0.5) / size
    X, Y = c[None, :], c[:, None]
    X.setflags(write=False)
    Y.setflags(write=False)
    return X, Y


def _ramp(z, s):
    """Soft step 0 -> 1 around z = 0 over width s (anti-aliased edge)."""
    return np.clip(z / s + 0.5, 0.0, 1.0)


def _lerp(img, value, alpha):
    return img + (value - img) * alpha


def _brighten(img, value, alpha):
    """Blend towards ``value`` but never darken: opacities add density."""
    return np.maximum(img, _lerp(img, value, alpha))


def _smooth_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Smooth random field in [0, 1]: a cells x cells grid upsampled bicubically."""
    small = Image.fromarray(rng.random((cells, cells), dtype=np.float32), mode="F")
    return np.asarray(small.resize((size, size), Image.BICUBIC), dtype=np.float32)


def _sgn(side: str) -> float:
    return -1.0 if side == "right" else 1.0  # patient right = image left


def _sides(side: str) -> tuple[str, ...]:
    return ("right", "left") if side == "bilateral" else (side,)


def _dome(g: Geometry, side: str) -> float:
    return g.dome_r if side == "right" else g.dome_l


def lung_lateral(g: Geometry, side: str, y):
    """Distance from the midline to the lateral chest wall at height y."""
    h = _dome(g, side) - g.apex_y
    return g.tw * (0.52 + 0.48 * np.sqrt(np.clip((y - g.apex_y) / (0.55 * h), 0.0, 1.0)))


def lung_mask(g: Geometry, side: str, X, Y, s, lateral_inset=0.0, top_inset=0.0):
    """Soft mask of one lung field; the insets pull the lateral wall and apex in (pneumothorax)."""
    d = _sgn(side) * (X - g.cx)
    top = g.apex_y + top_inset + 0.35 * ((d - 0.45 * g.tw) / g.tw) ** 2
    bottom = _dome(g, side) + 0.45 * ((d - 0.5 * g.tw) / g.tw) ** 2
    return (_ramp(lung_lateral(g, side, Y) - lateral_inset - d, s) * _ramp(d - g.mw, s)
            * _ramp(Y - top, s) * _ramp(bottom - Y, s))


def heart_geometry(g: Geometry) -> tuple[float, float, float, float]:
    """(centre x, centre y, half width, half height); half width = CTR x thoracic half width."""
    hw = g.ctr * g.tw
    hh = 0.6 * hw + 0.05
    hcy = 0.5 * (g.dome_r + g.dome_l) - 0.3 * hh
    return g.cx + g.heart_shift * hw, hcy, hw, hh


def heart_mask(g: Geometry, X, Y, s):
    hcx, hcy, hw, hh = heart_geometry(g)
    r = np.sqrt(((X - hcx) / hw) ** 2 + ((Y - hcy) / hh) ** 2)
    below = np.clip((0.5 * (g.dome_r + g.dome_l) + 0.04 - Y) / 0.04, 0.0, 1.0)
    return _ramp((1.0 - r) * min(hw, hh), s) * below


def zone_point(g: Geometry, side: str, zone: str, u: float, t: float) -> tuple[float, float]:
    """A point in a lung zone: u across the lung (0 medial .. 1 lateral), t down the zone."""
    z0, z1 = ZONES[zone]
    y = g.apex_y + (_dome(g, side) - g.apex_y) * (z0 + t * (z1 - z0))
    lat = float(lung_lateral(g, side, y))
    d = g.mw + 0.04 + u * (lat - g.mw - 0.08)
    return g.cx + _sgn(side) * d, y


def lesion_radius(g: Geometry, f: Finding) -> float:
    return 0.5 * f.params["diameter_mm"] / THORAX_MM * 2 * g.tw


# ---- finding regions (envelopes without texture): used for pixels and for boxes ----

def effusion_mask(g: Geometry, f: Finding, X, Y, s):
    out = 0.0
    for side in _sides(f.side):
        d = _sgn(side) * (X - g.cx)
        dome = _dome(g, side)
        sulcus = dome + 0.45 * 0.25
        h = f.params["height_frac"] * (dome - g.apex_y)
        q = np.clip((d - g.mw) / (g.tw - g.mw), 0.0, 1.0)
        level = sulcus - h + 0.4 * h * (1.0 - q) ** 2  # meniscus: higher at the chest wall
        fluid = np.clip((Y - level) / 0.03, 0.0, 1.0)
        bottom = dome + 0.45 * ((d - 0.5 * g.tw) / g.tw) ** 2 + 0.01
        out = out + fluid * _ramp(lung_lateral(g, side, Y) - d, s) * _ramp(d - 0.6 * g.mw, s) * _ramp(bottom - Y, s)
    return out


def _pneumothorax_insets(g: Geometry, f: Finding, Y):
    """(lateral inset at each height, apical inset): the air gap between chest wall and lung."""
    shrink, h = f.params["shrink"], _dome(g, f.side) - g.apex_y
    reach = (0.45 + shrink) * h  # how far down the lateral gap runs
    taper = np.clip((g.apex_y + reach - Y) / reach, 0.0, 1.0)
    return 0.5 * shrink * g.tw * taper, shrink * h


def _collapsed_lung(g: Geometry, f: Finding, X, Y, s):
    lateral, top = _pneumothorax_insets(g, f, Y)
    return lung_mask(g, f.side, X, Y, s * 0.8, lateral_inset=lateral, top_inset=top)


def pneumothorax_mask(g: Geometry, f: Finding, X, Y, s):
    return lung_mask(g, f.side, X, Y, s) * (1.0 - _collapsed_lung(g, f, X, Y, s))


def lesion_mask(g: Geometry, f: Finding, X, Y, s):
    x, y = zone_point(g, f.side, f.zone, f.params["u"], f.params["t"])
    r = lesion_radius(g, f)
    dist = np.sqrt((X - x) ** 2 + (Y - y) ** 2)
    if f.kind == "mass":  # lobulated outline
        theta = np.arctan2(Y - y, X - x)
        r = r * (1.0 + 0.1 * np.cos(3 * theta + f.params["u"] * 6.0))
    return np.clip((r - dist) / np.maximum(0.3 * r, s) + 0.5, 0.0, 1.0)


def _patch_envelope(g: Geometry, f: Finding, side: str, X, Y):
    level = SEVERITIES[f.kind].index(f.severity)
    x, y = zone_point(g, side, f.zone, f.params["u"], f.params["t"])
    ex = (0.07, 0.095, 0.12)[level] * f.params["extent"] * g.tw / 0.37
    ey = 0.8 * ex
    return np.sqrt(np.clip(1.0 - ((X - x) / ex) ** 2 - ((Y - y) / ey) ** 2, 0.0, 1.0))


def patch_mask(g: Geometry, f: Finding, X, Y, s):
    return sum(_patch_envelope(g, f, side, X, Y) * lung_mask(g, side, X, Y, s) for side in _sides(f.side))


def atelectasis_mask(g: Geometry, f: Finding, X, Y, s):
    out = 0.0
    th = f.params["thickness"]
    for side in _sides(f.side):
        d = _sgn(side) * (X - g.cx)
        d0 = g.mw + (0.3 + 0.4 * f.params["u"]) * (g.tw - g.mw)
        line = _dome(g, side) - 0.06 + f.params["tilt"] * (d - d0)
        along = np.clip(1.0 - ((d - d0) / (0.11 * g.tw / 0.37)) ** 2, 0.0, 1.0)
        out = out + np.exp(-(((Y - line) / th) ** 2)) * along * lung_mask(g, side, X, Y, s)
    return out


def hila(g: Geometry) -> list[tuple[float, float]]:
    y = g.apex_y + 0.45 * g.height
    return [(g.cx - g.mw - 0.08, y), (g.cx + g.mw + 0.08, y)]


def edema_mask(g: Geometry, f: Finding, X, Y, s):
    spread = (1.0, 1.2, 1.4)[SEVERITIES["edema"].index(f.severity)]
    haze = 0.0
    for hx, hy in hila(g):
        haze = np.maximum(haze, np.exp(-(((X - hx) / (0.1 * spread)) ** 2 + ((Y - hy) / (0.14 * spread)) ** 2)))
    lungs = lung_mask(g, "right", X, Y, s) + lung_mask(g, "left", X, Y, s)
    return haze * lungs


REGION_MASKS = {"pleural_effusion": effusion_mask, "pneumothorax": pneumothorax_mask,
                "nodule": lesion_mask, "mass": lesion_mask, "consolidation": patch_mask,
                "lung_opacity": patch_mask, "atelectasis": atelectasis_mask, "edema": edema_mask,
                "cardiomegaly": lambda g, f, X, Y, s: heart_mask(g, X, Y, s)}


# ---- devices: polylines in normalised coordinates ----

def _bezier(points, n: int = 24) -> list[tuple[float, float]]:
    """n points along the Bezier curve with these control points (de Casteljau)."""
    pts = np.asarray(points, dtype=np.float64)
    t = np.linspace(0.0, 1.0, n)[:, None, None]
    cur = np.broadcast_to(pts, (n,) + pts.shape)
    while cur.shape[1] > 1:
        cur = (1 - t) * cur[:, :-1] + t * cur[:, 1:]
    return [(float(x), float(y)) for x, y in cur[:, 0]]


def device_paths(g: Geometry, f: Finding) -> tuple[list[list[tuple[float, float]]], list[tuple[float, float, float]]]:
    """(polylines, electrodes as (x, y, r)) of one support device."""
    j = 0.01 * f.params["jitter"]
    cx, car = g.cx, g.carina_y
    if f.device == "endotracheal_tube":
        return [_bezier([(cx + 0.01, 0.0), (cx + j, 0.5 * car), (cx, car - 0.04 + j)])], []
    if f.device == "central_venous_catheter":
        sgn = _sgn(f.side)
        start = (cx + sgn * 0.07, 0.0)
        return [_bezier([start, (cx + sgn * 0.1, g.apex_y + 0.02 + j), (cx - 0.035, car + 0.06 + j)])], []
    if f.device == "nasogastric_tube":
        stomach = (cx + 0.5 * g.tw, g.dome_l + 0.1 + j)
        return [_bezier([(cx - 0.005, 0.0), (cx + 0.01, 0.5 * (g.dome_l + g.apex_y)),
                         (cx + 0.02, g.dome_l + 0.12), stomach])], []
    if f.device == "ecg_leads":
        rng = np.random.default_rng(f.params["seed"])
        paths, pads = [], []
        for k, (px, py) in enumerate([(cx - 0.25, g.apex_y + 0.05), (cx + 0.25, g.apex_y + 0.05),
                                      (cx + 0.2, g.dome_l - 0.05)]):
            px, py = px + float(rng.uniform(-0.04, 0.04)), py + float(rng.uniform(-0.03, 0.03))
            pads.append((px, py, 0.018))
            end = (0.0 if px < cx else 1.0, py + float(rng.uniform(-0.2, 0.2)))
            mid = (0.5 * (px + end[0]), 0.5 * (py + end[1]) + float(rng.uniform(-0.1, 0.1)))
            paths.append(_bezier([(px, py), mid, end]))
        return paths, pads
    raise ValueError(f"unknown phantom device {f.device!r}")


def _device_layer(g: Geometry, devices: list[Finding], size: int) -> np.ndarray:
    layer = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(layer)
    for f in devices:
        paths, pads = device_paths(g, f)
        width = max(1, round(size * (0.011 if f.device.endswith("tube") else 0.006)))
        for path in paths:
            draw.line([(x * size, y * size) for x, y in path], fill=255, width=width, joint="curve")
        for x, y, r in pads:
            draw.ellipse([(x - r) * size, (y - r) * size, (x + r) * size, (y + r) * size],
                         outline=255, width=max(1, round(size * 0.006)))
    return np.asarray(layer, dtype=np.float32) * (1.0 / 255.0)


# ---- boxes ----

def finding_boxes(case: Case, size: int) -> list[dict]:
    """One box per finding, [x0, y0, x1, y1] in pixels of a ``size`` x ``size`` render."""
    g = case.geometry
    X, Y = _grid(BOX_GRID)
    s = 1.5 / BOX_GRID
    boxes = []
    for f in case.findings:
        if f.kind == DEVICE:
            paths, pads = device_paths(g, f)
            if pads:  # ECG leads: the electrodes, not the wires running off the image
                pts = np.array([(x + dx * r, y + dy * r) for x, y, r in pads for dx, dy in ((-1, -1), (1, 1))])
            else:
                pts = np.array([p for path in paths for p in path])
            pad = 0.01
            box = [pts[:, 0].min() - pad, pts[:, 1].min() - pad, pts[:, 0].max() + pad, pts[:, 1].max() + pad]
        elif f.kind in ("nodule", "mass"):
            x, y = zone_point(g, f.side, f.zone, f.params["u"], f.params["t"])
            r = lesion_radius(g, f) * 1.1 + 1.0 / size
            box = [x - r, y - r, x + r, y + r]
        else:
            mask = REGION_MASKS[f.kind](g, f, X, Y, s) > 0.3
            if not mask.any():
                raise RuntimeError(f"phantom {case.id}: empty region for {f.kind}")
            if f.side == "bilateral":  # one box per lung: a box over both would hold the heart
                for side, half in (("right", X < g.cx), ("left", X >= g.cx)):
                    if (mask & half).any():
                        boxes.append(_pixel_box(f.kind, _mask_box(mask & half), size, side))
                continue
            box = _mask_box(mask)
        boxes.append(_pixel_box(f.kind, box, size, f.side))
    return boxes


def _mask_box(mask: np.ndarray) -> list[float]:
    """Bounding box [x0, y0, x1, y1] (normalised) of a non-empty BOX_GRID mask."""
    r0, r1 = np.flatnonzero(np.any(mask, axis=1))[[0, -1]]
    c0, c1 = np.flatnonzero(np.any(mask, axis=0))[[0, -1]]
    return [c0 / BOX_GRID, r0 / BOX_GRID, (c1 + 1) / BOX_GRID, (r1 + 1) / BOX_GRID]


def _pixel_box(label: str, box: list[float], size: int, side: str) -> dict:
    x0, y0, x1, y1 = (float(np.clip(v, 0.0, 1.0)) * size for v in box)
    out = {"label": label, "box": [round(x0, 1), round(y0, 1), round(x1, 1), round(y1, 1)]}
    if side:
        out["side"] = side
    return out


# ---- the image ----

def render_case(case: Case, size: int = 256) -> Image.Image:
    """Draw one phantom study as an 8-bit grayscale ``size`` x ``size`` PIL image."""
    if size < 16:
        raise ValueError(f"phantom image size must be >= 16 px, got {size}")
    rng = np.random.default_rng(stable_seed("phantom-render", case.seed, case.index))
    c = _Canvas(case.geometry, size)
    img = _draw_body(c)
    img = _draw_lungs(c, case, img, rng)
    img = _draw_mediastinum(c, img)
    img = _draw_findings(c, case, img)
    img = _draw_bones(c, img)
    if case.devices:
        img = img + 0.3 * _device_layer(c.g, case.devices, size)
    # Exposure and noise.
    g = c.g
    img = (np.clip(img, 0.0, 1.0) - 0.45) * g.contrast + 0.45 + g.brightness
    img = np.clip(img, 0.0, 1.0) ** g.gamma
    img = img + rng.standard_normal(img.shape, dtype=np.float32) * g.noise
    return Image.fromarray((np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8), mode="L")


class _Canvas:
    """The pixel grid of one drawing and the geometry every layer is placed by."""

    def __init__(self, g: Geometry, size: int):
        self.g, self.size = g, size
        self.X, self.Y = _grid(size)
        self.s = 1.5 / size  # edge softness: about one pixel
        self.dx = self.X - g.cx
        self.adx = np.abs(self.dx)
        self.dome_mid = 0.5 * (g.dome_r + g.dome_l)


def _draw_body(c: _Canvas) -> np.ndarray:
    """Soft tissue thicker in the middle, narrowing to the neck above the shoulders."""
    g, Y, s = c.g, c.Y, c.s
    shoulder = np.clip((Y - (g.apex_y - 0.13)) / 0.1, 0.0, 1.0)
    half = g.neck + (g.bw * (0.96 + 0.06 * Y) - g.neck) * np.sqrt(shoulder * (2.0 - shoulder))
    thick = np.sqrt(np.clip(1.0 - (c.dx / g.bw) ** 2, 0.0, 1.0))
    soft = 0.3 + 0.28 * thick + 0.05 * np.clip((Y - c.dome_mid - 0.04) / 0.06, 0.0, 1.0)
    return _lerp(np.float32(AIR), soft, _ramp(half - c.adx, s))


def _draw_lungs(c: _Canvas, case: Case, img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Lungs with vascular markings that fade from the hila to the periphery (and pneumothoraces)."""
    g, X, Y, s = c.g, c.X, c.Y, c.s
    lung_r, lung_l = lung_mask(g, "right", X, Y, s), lung_mask(g, "left", X, Y, s)
    hil = 0.0
    for hx, hy in hila(g):
        hil = np.maximum(hil, np.exp(-(((X - hx) / 0.12) ** 2 + ((Y - hy) / 0.16) ** 2)))
    texture = _smooth_noise(rng, c.size, 22) - 0.5
    vessels = 0.08 * hil + texture * (0.05 + 0.07 * hil)
    lung_val = LUNG + vessels + 0.06 * np.clip((Y - g.apex_y) / g.height, 0.0, 1.0)
    for f in case.findings:
        if f.kind == "pneumothorax":  # no markings outside the collapsed lung, visible pleural line
            collapsed = _collapsed_lung(g, f, X, Y, s)
            lung_side = lung_r if f.side == "right" else lung_l
            lung_val = _lerp(lung_val, 0.05, lung_side * (1.0 - collapsed))
            # The visceral pleural line: the collapsed lung's edge, where it has left the wall.
            lateral, _ = _pneumothorax_insets(g, f, Y)
            detached = np.minimum(lateral / (2 * s), 1.0) * _ramp(_sgn(f.side) * (X - g.cx) - g.mw - 3 * s, s)
            detached = np.maximum(detached, _ramp(Y - g.apex_y - 2 * s, s) * (Y < g.apex_y + 0.1))
            lung_val = lung_val + 0.02 * collapsed + 0.3 * lung_side * detached * 4.0 * collapsed * (1.0 - collapsed)
    return _lerp(img, lung_val, np.minimum(lung_r + lung_l, 1.0) * 0.95)


def _draw_mediastinum(c: _Canvas, img: np.ndarray) -> np.ndarray:
    """Mediastinum, trachea, aortic knob, heart, gastric bubble."""
    g, X, Y, s, adx = c.g, c.X, c.Y, c.s, c.adx
    med = _ramp(g.mw * 1.05 - adx, s) * _ramp(Y - (g.apex_y - 0.12), s) * _ramp(c.dome_mid - Y, s)
    img = _lerp(img, MEDIASTINUM, med * 0.8)
    trachea = _ramp(0.014 - adx, s) * _ramp(g.carina_y - Y, 0.02) * _ramp(Y - (g.apex_y - 0.15), s)
    img = _lerp(img, 0.4, trachea * 0.5)
    knob = np.sqrt(((X - g.cx - g.mw + 0.005) / 0.04) ** 2 + ((Y - g.apex_y - 0.13) / 0.04) ** 2)
    img = _brighten(img, MEDIASTINUM, 0.8 * _ramp(1.0 - knob, 0.15))
    img = _lerp(img, HEART, heart_mask(g, X, Y, s))
    if g.gastric_bubble:
        bubble = np.sqrt(((X - g.cx - 0.5 * g.tw) / 0.05) ** 2 + ((Y - g.dome_l - 0.065) / 0.028) ** 2)
        img = _lerp(img, 0.32, 0.7 * _ramp(1.0 - bubble, 0.15) * (Y > g.dome_l + 0.045))
    return img


def _draw_findings(c: _Canvas, case: Case, img: np.ndarray) -> np.ndarray:
    """Findings (pneumothorax already drawn into the lung texture, cardiomegaly by the CTR)."""
    g, X, Y, s, size = c.g, c.X, c.Y, c.s, c.size
    for f in case.findings:
        if f.kind == "pleural_effusion":
            img = _brighten(img, FLUID, 0.95 * np.minimum(effusion_mask(g, f, X, Y, s), 1.0))
        elif f.kind in ("nodule", "mass"):
            img = _brighten(img, 0.62, 0.9 * lesion_mask(g, f, X, Y, s))
        elif f.kind in ("consolidation", "lung_opacity"):
            patchy = _smooth_noise(np.random.default_rng(f.params["seed"]), size,
                                   12 if f.kind == "consolidation" else 6)
            env = patch_mask(g, f, X, Y, s)
            amount = np.clip(env * (0.5 + 1.6 * (patchy - 0.5)) + 0.5 * env, 0.0, 1.0)
            if f.kind == "lung_opacity":
                amount = amount * env  # softer, hazier edges
            img = _brighten(img, 0.6, f.params["alpha"] * amount)
        elif f.kind == "atelectasis":
            img = _brighten(img, 0.62, 0.85 * np.minimum(atelectasis_mask(g, f, X, Y, s), 1.0))
        elif f.kind == "edema":
            mottle = _smooth_noise(np.random.default_rng(f.params["seed"]), size, 16)
            img = _brighten(img, 0.55, f.params["alpha"] * edema_mask(g, f, X, Y, s) * (0.7 + 0.6 * (mottle - 0.5)))
    return img


def _draw_bones(c: _Canvas, img: np.ndarray) -> np.ndarray:
    """Spine, posterior ribs (faint periodic arcs), clavicles."""
    g, X, Y, s, adx = c.g, c.X, c.Y, c.s, c.adx
    img = img + 0.06 * _ramp(0.03 - adx, s) * (0.7 + 0.3 * np.cos(Y * (2 * np.pi / 0.042))) * (Y > g.apex_y - 0.2)
    dn = adx / g.tw
    spacing = (g.dome_r + 0.06 - g.apex_y) / g.rib_count
    phase = (Y - g.apex_y + 0.03 - (-0.08 * dn + 0.3 * dn * dn)) / spacing + g.rib_phase
    ribs = np.clip(np.cos(2 * np.pi * phase), 0.0, 1.0) ** 2
    ribs = ribs * _ramp(g.tw * 1.06 - adx, s) * _ramp(adx - 0.03, s) * np.clip((Y - g.apex_y + 0.05) / 0.03, 0, 1) \
        * np.clip((g.dome_r + 0.07 - Y) / 0.05, 0, 1)
    img = img + 0.045 * ribs
    for sgn in (-1.0, 1.0):
        ax, ay, bx, by = g.cx + sgn * 0.05, g.apex_y + 0.03, g.cx + sgn * 0.3, g.apex_y - 0.045
        t = np.clip(((X - ax) * (bx - ax) + (Y - ay) * (by - ay)) / ((bx - ax) ** 2 + (by - ay) ** 2), 0.0, 1.0)
        dist2 = (X - ax - t * (bx - ax)) ** 2 + (Y - ay - t * (by - ay)) ** 2
        img = img + 0.1 * np.exp(-dist2 / 0.011 ** 2)
    return img
