"""Statistics over seeds: t-intervals, seed-mean curves, samples needed to reach a target."""
from __future__ import annotations

import math

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
