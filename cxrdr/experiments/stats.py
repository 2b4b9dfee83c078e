"""Statistics over seeds: t-intervals, seed-mean curves, samples needed to reach a target."""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import t


def t_interval(values: list[float], confidence: float = 0.95) -> tuple[float | None, float | None]:
    """(mean, half-width of the two-sided t-interval of the mean); half-width None below 2 values."""
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not values:
        return None, None
    mean, sd = mean_sd(values)
    if sd is None:
        return mean, None
    return mean, float(t.ppf(0.5 + confidence / 2, len(values) - 1)) * sd / math.sqrt(len(values))


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None below 2 values)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, sd


def samples_to_target(xs: list[float], ys: list[float], target: float) -> float | None:
    """First samples count at which the curve (xs ascending) reaches ``target``, interpolated linearly
    between the two evaluations around the crossing. Reached at the first evaluation already: that
    evaluation's x (nothing was measured before it, so it is an upper bound). Never reached: None."""
    prev = None
    for x, y in zip(xs, ys):
        if y is None:
            continue
        if y >= target:
            if prev is None:
                return float(x)
            (x0, y0) = prev
            return float(x0 + (x - x0) * (target - y0) / (y - y0)) if y != y0 else float(x)
        prev = (x, y)
    return None


def mean_curve(curves: list[list[dict]], metric: str = "mean_recall") -> dict:
    """Seed-mean curve on the samples points every seed evaluated: {xs, mean, ci}."""
    common = sorted(set.intersection(*[{p["samples_seen"] for p in c} for c in curves])) if curves else []
    means, cis = [], []
    for x in common:
        values = [next(p[metric] for p in c if p["samples_seen"] == x) for c in curves]
        m, h = t_interval([v for v in values if v is not None])
        means.append(m)
        cis.append(h)
    return {"xs": common, "mean": means, "ci": cis}


def first_crossing(curve: dict, target: float | None) -> float | None:
    """``samples_to_target`` on a seed-mean curve ``{xs, mean}`` (None without a target)."""
    if target is None or not curve.get("xs"):
        return None
    return samples_to_target(curve["xs"], curve["mean"], target)


def crossing_ratio(arm_curves: list[list[dict]], plain_curves: list[list[dict]], metric: str = "mean_recall",
                   n_boot: int = 2000, seed: int = 0, confidence: float = 0.95) -> dict:
    """The one crossing rule for every arm, and its interval over seeds.

    Target: plain's final seed-mean value. Each arm's samples = the first crossing of its own seed-mean
    curve (plain's too: where plain itself first reaches its final); ratio = arm / plain. The interval
    resamples the seeds of both arms with replacement (percentile bootstrap): target, both curves and both
    crossings are recomputed each time; a resample whose arm never reaches the target counts as an
    infinite ratio (so it widens the interval instead of being dropped)."""
    arm, plain = mean_curve(arm_curves, metric), mean_curve(plain_curves, metric)
    target = plain["mean"][-1] if plain["mean"] else None
    arm_x, plain_x = first_crossing(arm, target), first_crossing(plain, target)
    ratio = arm_x / plain_x if arm_x is not None and plain_x else None
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(n_boot if len(arm_curves) > 1 and len(plain_curves) > 1 else 0):
        a = mean_curve([arm_curves[i] for i in rng.integers(0, len(arm_curves), len(arm_curves))], metric)
        p = mean_curve([plain_curves[i] for i in rng.integers(0, len(plain_curves), len(plain_curves))], metric)
        tgt = p["mean"][-1]
        ax, px = first_crossing(a, tgt), first_crossing(p, tgt)
        if px:
            ratios.append(math.inf if ax is None else ax / px)
    # no interpolation between resamples: one that never crosses stays infinite instead of becoming NaN
    lo, hi = (np.percentile(ratios, [50 * (1 - confidence), 50 * (1 + confidence)], method="inverted_cdf").tolist()
              if ratios else (None, None))
    return {"target": target, "samples": arm_x, "plain_samples": plain_x, "ratio": ratio,
            "ratio_ci": [lo, hi], "n_boot": len(ratios), "rule": "first crossing of each arm's seed-mean "
            "curve of plain's final seed-mean value; ratio to plain's own first crossing"}
