"""What one phantom study shows: subject layout, body geometry and findings, sampled cheaply.

Everything here is deterministic in ``(seed, index)`` and needs no pixels, so a source can
build all its records (report, triples, labels, boxes) before any worker renders an image.

Subject layout. Indices come in blocks of 16; each block is cut into subjects of 1-4
consecutive studies (deterministic in ``(seed, block)``), so ``index -> (subject, study)`` is
O(1) and a phantom set of size n is a prefix of any larger one with the same seed (only the
last subject may lose studies). A subject is named after the index of its first study:
``ph-s00012`` owns studies ``ph-s00012-st1`` .. ``ph-s00012-st4`` (1-based).

Studies of one subject share body habitus (thorax size, normal heart size, lung height);
each study adds its own position, inspiration, exposure, noise and view (PA/AP). Findings of
a follow-up study evolve from the previous one: they persist, change severity by one step,
resolve, or a new one appears.

Coordinates are normalised: x, y in [0, 1], x to the image right, y down. Images follow the
radiological convention, so the patient's RIGHT lung is on the image LEFT.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from cxrdr.common.augment import stable_seed

BLOCK = 16
STUDY_COUNT_P = (0.35, 0.30, 0.20, 0.15)  # P(1..4 studies per subject)
NORMAL_P = 0.32  # P(no pathology); support devices may still be present
N_PATHOLOGY_P = (0.50, 0.33, 0.17)  # P(1, 2, 3 pathologies | abnormal)
DEVICE_P = 0.22
MAX_FINDINGS = 3  # pathologies + devices

# Finding kinds (snake_case: also box labels and triple subjects) and their sampling weights.
PATHOLOGY_WEIGHTS: dict[str, float] = {
    "cardiomegaly": 0.18, "pleural_effusion": 0.18, "pneumothorax": 0.09, "nodule": 0.08,
    "mass": 0.05, "consolidation": 0.11, "lung_opacity": 0.09, "atelectasis": 0.10,
    "edema": 0.08,
}
PATHOLOGIES = tuple(PATHOLOGY_WEIGHTS)
DEVICE = "support_device"

# Severity vocabulary per kind, mildest first ("size" words for things that have a size).
SEVERITIES: dict[str, tuple[str, ...]] = {
    "cardiomegaly": ("mild", "moderate", "severe"),
    "pleural_effusion": ("small", "moderate", "large"),
    "pneumothorax": ("small", "moderate", "large"),
    "nodule": ("small", "moderate", "large"),
    "mass": ("small", "moderate", "large"),
    "consolidation": ("mild", "moderate", "severe"),
    "lung_opacity": ("mild", "moderate", "severe"),
    "atelectasis": ("minimal", "mild", "moderate"),
    "edema": ("mild", "moderate", "severe"),
}
DEVICE_TYPES = ("endotracheal_tube", "central_venous_catheter", "nasogastric_tube", "ecg_leads")

# Cardiothoracic ratio ranges: normal habitus, then by cardiomegaly severity.
CTR_NORMAL = (0.38, 0.47)
CTR_BY_SEVERITY = {"mild": (0.53, 0.57), "moderate": (0.58, 0.63), "severe": (0.64, 0.70)}
# Lesion diameters in mm (the thorax is taken as 300 mm wide): mass > 30 mm.
LESION_MM = {"nodule": {"small": (5, 9), "moderate": (10, 19), "large": (20, 29)},
             "mass": {"small": (32, 40), "moderate": (41, 55), "large": (56, 75)}}
THORAX_MM = 300.0


@dataclass
class Finding:
    kind: str  # a PATHOLOGIES name or "support_device"
    side: str = ""  # right | left | bilateral | "" (cardiomegaly, midline devices)
    zone: str = ""  # apex | upper | mid | lower | base | perihilar | "" (heart, devices)
    severity: str = ""  # from SEVERITIES[kind]; "" for devices
    device: str = ""  # DEVICE_TYPES name for support_device
    params: dict = field(default_factory=dict)  # placement within the zone, sizes, seeds

    def to_json(self) -> dict:
        return {"kind": self.kind, "side": self.side, "zone": self.zone,
                "severity": self.severity, "device": self.device,
                "params": {k: round(v, 4) if isinstance(v, float) else v
                           for k, v in sorted(self.params.items())}}


@dataclass
class Geometry:
    """Body habitus plus this study's position; all lengths normalised to the image side."""

    cx: float  # midline
    tw: float  # half of the internal thoracic width
    bw: float  # half of the body width
    neck: float  # half width of the neck
    apex_y: float
    dome_r: float  # top of the right hemidiaphragm dome (image left)
    dome_l: float
    mw: float  # half width of the upper mediastinum
    ctr: float  # cardiothoracic ratio actually drawn
    heart_shift: float  # heart centre offset to the patient's left, in heart half-widths
    rib_count: int
    rib_phase: float
    gastric_bubble: bool
    brightness: float
    contrast: float
    gamma: float
    noise: float

    @property
    def height(self) -> float:  # lung height (apex to the higher dome)
        return min(self.dome_r, self.dome_l) - self.apex_y

    @property
    def carina_y(self) -> float:
        return self.apex_y + 0.16


@dataclass
class Case:
    seed: int
    index: int
    id: str
    subject_id: str
    study_id: str
    study_number: int  # 1-based within the subject
    view: str  # PA | AP
    geometry: Geometry
    findings: list[Finding]

    @property
    def pathologies(self) -> list[Finding]:
        return [f for f in self.findings if f.kind != DEVICE]

    @property
    def devices(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == DEVICE]

    def has(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.findings)


def subject_layout(seed: int, index: int) -> tuple[int, int, int]:
    """(index of the subject's first study, 0-based study number, studies in the subject)."""
    if index < 0:
        raise ValueError(f"phantom index must be >= 0, got {index}")
    block = index // BLOCK
    rng = np.random.default_rng(stable_seed("phantom", seed, "block", block))
    start = block * BLOCK
    while True:
        count = int(rng.choice(4, p=STUDY_COUNT_P)) + 1
        count = min(count, (block + 1) * BLOCK - start)
        if start + count > index:
            return start, index - start, count
        start += count


def sample_case(seed: int, index: int) -> Case:
    """The study at ``index``: ids, view, geometry and findings (no pixels)."""
    first, number, _ = subject_layout(seed, index)
    subject_id = f"ph-s{first:05d}"
    habitus = _sample_habitus(np.random.default_rng(stable_seed("phantom", seed, "subject", first)))
    findings: list[Finding] = []
    for j in range(number + 1):  # follow-ups evolve from the previous study
        rng = np.random.default_rng(stable_seed("phantom", seed, "study", first + j))
        findings = _sample_findings(rng) if j == 0 else _evolve(findings, rng)
    geometry, view = _study_geometry(habitus, findings, rng)
    study_id = f"{subject_id}-st{number + 1}"
    return Case(seed=seed, index=index, id=study_id, subject_id=subject_id, study_id=study_id,
                study_number=number + 1, view=view, geometry=geometry, findings=findings)


def _sample_habitus(rng: np.random.Generator) -> dict:
    tw = float(rng.uniform(0.34, 0.40))
    return {"tw": tw, "bw": tw + float(rng.uniform(0.06, 0.09)), "neck": float(rng.uniform(0.08, 0.11)),
            "apex_y": float(rng.uniform(0.10, 0.14)), "dome": float(rng.uniform(0.66, 0.73)),
            "dome_gap": float(rng.uniform(0.01, 0.035)), "mw": float(rng.uniform(0.045, 0.06)),
            "ctr": float(rng.uniform(*CTR_NORMAL)), "heart_shift": float(rng.uniform(0.15, 0.3)),
            "rib_count": int(rng.integers(9, 11)), "gastric_bubble": bool(rng.random() < 0.6)}


def _study_geometry(h: dict, findings: list[Finding], rng) -> tuple[Geometry, str]:
    view = "AP" if rng.random() < 0.3 else "PA"
    ctr = h["ctr"]
    for f in findings:
        if f.kind == "cardiomegaly":
            ctr = f.params["ctr"]
    inspiration = float(rng.uniform(-0.02, 0.02))
    geometry = Geometry(
        cx=0.5 + float(rng.uniform(-0.015, 0.015)), tw=h["tw"], bw=h["bw"], neck=h["neck"],
        apex_y=h["apex_y"] + float(rng.uniform(-0.01, 0.01)),
        dome_r=h["dome"] + inspiration, dome_l=h["dome"] + inspiration + h["dome_gap"],
        mw=h["mw"], ctr=ctr, heart_shift=h["heart_shift"], rib_count=h["rib_count"],
        rib_phase=float(rng.uniform(-0.15, 0.15)), gastric_bubble=h["gastric_bubble"],
        brightness=float(rng.uniform(-0.06, 0.06)), contrast=float(rng.uniform(0.85, 1.2)),
        gamma=float(rng.uniform(0.8, 1.25)), noise=float(rng.uniform(0.008, 0.03)))
    return geometry, view


def _sample_findings(rng: np.random.Generator) -> list[Finding]:
    findings: list[Finding] = []
    if rng.random() >= NORMAL_P:
        n = int(rng.choice(3, p=N_PATHOLOGY_P)) + 1
        weights = np.array([PATHOLOGY_WEIGHTS[k] for k in PATHOLOGIES])
        kinds = rng.choice(len(PATHOLOGIES), size=n, replace=False, p=weights / weights.sum())
        findings = [new_finding(PATHOLOGIES[int(k)], rng) for k in sorted(kinds)]
        effusion = next((f for f in findings if f.kind == "pleural_effusion"), None)
        if (effusion and len(findings) < MAX_FINDINGS and not any(f.kind == "atelectasis" for f in findings)
                and rng.random() < 0.35):  # compressive atelectasis next to the fluid
            side = "right" if effusion.side == "bilateral" else effusion.side
            findings.append(new_finding("atelectasis", rng, side=side))
    if len(findings) < MAX_FINDINGS and rng.random() < DEVICE_P:
        room = MAX_FINDINGS - len(findings)
        n_dev = min(room, 1 + int(rng.random() < 0.3))
        for d in sorted(rng.choice(len(DEVICE_TYPES), size=n_dev, replace=False)):
            findings.append(new_device(DEVICE_TYPES[int(d)], rng))
    return findings


def _evolve(previous: list[Finding], rng: np.random.Generator) -> list[Finding]:
    out: list[Finding] = []
    for f in previous:
        r = rng.random()
        if f.kind == DEVICE:
            if r >= 0.4:
                out.append(f)
            continue
        resolve_p = 0.05 if f.kind == "cardiomegaly" else 0.2
        if r < resolve_p:
            continue
        scale = SEVERITIES[f.kind]
        step = 0 if r < resolve_p + 0.45 else (1 if rng.random() < 0.5 else -1)
        level = int(np.clip(scale.index(f.severity) + step, 0, len(scale) - 1))
        out.append(f if scale[level] == f.severity else _with_severity(f, scale[level], rng))
    if len(out) < MAX_FINDINGS and rng.random() < 0.25:
        present = {f.kind for f in out}
        candidates = [k for k in PATHOLOGIES if k not in present]
        kind = candidates[int(rng.integers(len(candidates)))]
        out.insert(0, new_finding(kind, rng))
    return out


def _with_severity(f: Finding, severity: str, rng) -> Finding:
    """Same lesion, new severity: keep placement, resample the severity-dependent sizes."""
    fresh = new_finding(f.kind, rng, side=f.side, zone=f.zone, severity=severity)
    params = dict(f.params)
    for key in ("ctr", "diameter_mm", "height_frac", "shrink", "alpha", "thickness"):
        if key in fresh.params:
            params[key] = fresh.params[key]
    return replace(f, severity=severity, params=params)


def _pick(rng, options, p=None) -> str:
    return options[int(rng.choice(len(options), p=p))]


def new_finding(kind: str, rng: np.random.Generator, side: str | None = None,
                zone: str | None = None, severity: str | None = None) -> Finding:
    """One pathology with side, zone, severity and placement parameters."""
    scale = SEVERITIES[kind]
    severity = severity or _pick(rng, scale, [0.4, 0.4, 0.2])
    level = scale.index(severity)
    u = float(rng.uniform(0.3, 0.7))  # across the lung, 0 medial .. 1 lateral
    t = float(rng.uniform(0.2, 0.8))  # within the zone, 0 top .. 1 bottom
    seed = int(rng.integers(0, 2**31 - 1))  # texture of patchy opacities
    if kind == "cardiomegaly":
        return Finding(kind, "", "", severity, params={"ctr": float(rng.uniform(*CTR_BY_SEVERITY[severity]))})
    if kind == "pleural_effusion":
        side = side or _pick(rng, ("right", "left", "bilateral"), [0.4, 0.35, 0.25])
        frac = (0.2, 0.33, 0.5)[level] + float(rng.uniform(-0.03, 0.03))
        return Finding(kind, side, "base", severity, params={"height_frac": frac})
    if kind == "pneumothorax":
        side = side or _pick(rng, ("right", "left"))
        shrink = (0.12, 0.22, 0.36)[level] + float(rng.uniform(-0.02, 0.02))
        return Finding(kind, side, "apex", severity, params={"shrink": shrink})
    if kind in ("nodule", "mass"):
        side = side or _pick(rng, ("right", "left"))
        zone = zone or _pick(rng, ("upper", "mid", "lower"))
        diameter = float(rng.uniform(*LESION_MM[kind][severity]))
        return Finding(kind, side, zone, severity, params={"u": u, "t": t, "diameter_mm": diameter,
                                                           "seed": seed})
    if kind in ("consolidation", "lung_opacity"):
        side = side or _pick(rng, ("right", "left", "bilateral"), [0.45, 0.4, 0.15])
        zone = zone or _pick(rng, ("upper", "mid", "lower"))
        alpha = ((0.45, 0.65, 0.85) if kind == "consolidation" else (0.3, 0.45, 0.6))[level]
        return Finding(kind, side, zone, severity, params={"u": u, "t": t, "alpha": alpha,
                                                           "extent": float(rng.uniform(0.8, 1.2)),
                                                           "seed": seed})
    if kind == "atelectasis":
        side = side or _pick(rng, ("right", "left", "bilateral"), [0.45, 0.45, 0.1])
        thickness = (0.007, 0.011, 0.016)[level]
        return Finding(kind, side, "base", severity, params={"thickness": thickness, "u": u,
                                                             "tilt": float(rng.uniform(-0.12, 0.12))})
    if kind == "edema":
        alpha = (0.35, 0.55, 0.75)[level]
        return Finding(kind, "bilateral", "perihilar", severity, params={"alpha": alpha, "seed": seed})
    raise ValueError(f"unknown phantom finding kind {kind!r}")


def new_device(device: str, rng: np.random.Generator) -> Finding:
    side = _pick(rng, ("right", "left"), [0.75, 0.25]) if device == "central_venous_catheter" else ""
    return Finding(DEVICE, side, "", "", device=device,
                   params={"seed": int(rng.integers(0, 2**31 - 1)), "jitter": float(rng.uniform(-1, 1))})
