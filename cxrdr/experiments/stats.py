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


def gap_interval(arm: list[float], ref: list[float], confidence: float = 0.95) -> dict:
    """Mean of ``arm`` - mean of ``ref`` with its Welch t-interval (two samples of seeds, unequal
    variances) and each side's sd; the half-width is None when either side has fewer than 2 values."""
    a = [float(v) for v in arm if v is not None and math.isfinite(float(v))]
    b = [float(v) for v in ref if v is not None and math.isfinite(float(v))]
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    gap = None if ma is None or mb is None else ma - mb
    half = None
    if gap is not None and sa is not None and sb is not None:
        half = welch_half_width(sa, len(a), sb, len(b), confidence)
    return {"gap": gap, "gap_ci": None if half is None else [gap - half, gap + half], "arm_mean": ma, "arm_sd": sa,
            "ref_mean": mb, "ref_sd": sb, "n_arm": len(a), "n_ref": len(b)}


def welch_half_width(sd_a: float, n_a: int, sd_b: float, n_b: int, confidence: float = 0.95) -> float:
    """Half-width of the Welch t-interval of a difference of two means, from each sample's sd and size
    (summaries that keep no values, e.g. a table's 'mean ± half-width' cells, recover the sd first)."""
    va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1)) if se > 0 else n_a + n_b - 2
    return float(t.ppf(0.5 + confidence / 2, df)) * se


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


def mean_curve(curves: list[list[dict]], metric: str = "mean_recall", with_ci: bool = True) -> dict:
    """Seed-mean curve on the samples points every seed evaluated: {xs, mean, ci}. ``with_ci=False``
    leaves the t-intervals out (ci None): the bootstraps need only the means, and the t quantile of
    every point of every resample made them minutes long."""
    common = sorted(set.intersection(*[{p["samples_seen"] for p in c} for c in curves])) if curves else []
    means, cis = [], []
    # each curve's first point at every samples count (a dict built back to front keeps the first)
    firsts = [{p["samples_seen"]: p.get(metric) for p in reversed(c)} for c in curves]
    for x in common:
        values = [v for v in (f[x] for f in firsts) if v is not None]
        m, h = t_interval(values) if with_ci else (mean_sd(values)[0], None)
        means.append(m)
        cis.append(h)
    return {"xs": common, "mean": means, "ci": cis if with_ci else None}


def first_crossing(curve: dict, target: float | None) -> float | None:
    """``samples_to_target`` on a seed-mean curve ``{xs, mean}`` (None without a target)."""
    if target is None or not curve.get("xs"):
        return None
    return samples_to_target(curve["xs"], curve["mean"], target)


def crossing_ratio(arm_curves: list[list[dict]], plain_curves: list[list[dict]], metric: str = "mean_recall",
                   n_boot: int = 2000, seed: int = 0, confidence: float = 0.95, fraction: float = 1.0) -> dict:
    """The one crossing rule for every arm, and its interval over seeds.

    Target: ``fraction`` x plain's final seed-mean value (1.0: plain's final itself; ``plain_curves`` may
    be any reference arm, whose own final is then the target). Each arm's samples = the first crossing of
    its own seed-mean curve (plain's too: where plain itself first reaches the target); ratio = arm /
    plain. The interval resamples the seeds of both arms with replacement (percentile bootstrap): target,
    both curves and both crossings are recomputed each time; a resample whose arm never reaches the target
    counts as an infinite ratio (so it widens the interval instead of being dropped)."""
    arm, plain = mean_curve(arm_curves, metric), mean_curve(plain_curves, metric)
    target = _target(plain, fraction)
    arm_x, plain_x = first_crossing(arm, target), first_crossing(plain, target)
    ratio = arm_x / plain_x if arm_x is not None and plain_x else None
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(n_boot if len(arm_curves) > 1 and len(plain_curves) > 1 else 0):
        a = mean_curve([arm_curves[i] for i in rng.integers(0, len(arm_curves), len(arm_curves))], metric, False)
        p = mean_curve([plain_curves[i] for i in rng.integers(0, len(plain_curves), len(plain_curves))], metric, False)
        tgt = _target(p, fraction)
        ax, px = first_crossing(a, tgt), first_crossing(p, tgt)
        if px:
            ratios.append(math.inf if ax is None else ax / px)
    # no interpolation between resamples: one that never crosses stays infinite instead of becoming NaN
    lo, hi = (np.percentile(ratios, [50 * (1 - confidence), 50 * (1 + confidence)], method="inverted_cdf").tolist()
              if ratios else (None, None))
    out = {"target": target, "samples": arm_x, "plain_samples": plain_x, "ratio": ratio,
           "ratio_ci": [lo, hi], "n_boot": len(ratios), "rule": "first crossing of each arm's seed-mean "
           "curve of plain's final seed-mean value; ratio to plain's own first crossing"}
    return out if fraction == 1.0 else {**out, "fraction": fraction}


def _target(curve: dict, fraction: float = 1.0) -> float | None:
    """``fraction`` of a seed-mean curve's last value (None without one); 1.0 returns the value itself."""
    if not curve["mean"] or curve["mean"][-1] is None:
        return None
    return curve["mean"][-1] if fraction == 1.0 else fraction * curve["mean"][-1]
