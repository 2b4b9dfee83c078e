"""Image-level uncertainty of pointing games, and paired margins over a baseline (issue 37).

A pointing game is a mean over *targets* (z: one per image; the attention: one per finding of an image),
but the evaluation set is a sample of *images*: the targets of one image share its anatomy, contrast and
report, so their hits are correlated. Every interval here is a percentile bootstrap that resamples
images with replacement and keeps each drawn image's targets together; a rate is then
(hits of the drawn targets) / (number of drawn targets), the same ratio the point estimate is.

A paired margin (model − baseline, e.g. the train-box prior) uses the *same* resampled images for both
on every replicate, so what the two share (an easy image both hit, a hard one both miss) cancels instead
of widening the interval. Identical hit vectors give a margin of exactly 0 with interval [0, 0].

Per-target values may be NaN (or None): "no value for this target" (e.g. the leave-one-out prior of a
finding seen once); such targets count neither in the numerator nor in the denominator, and a paired
margin keeps only targets where both sides have a value.

numpy only; deterministic for a given ``seed``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

N_BOOT = 2000
CONFIDENCE = 0.95
SEED = 0


def image_resamples(n_images: int, n_boot: int = N_BOOT, seed: int = SEED) -> np.ndarray:
    """(n_boot, n_images) indices: each row draws ``n_images`` of the images with replacement."""
    return np.random.default_rng(seed).integers(0, max(n_images, 1), size=(n_boot, n_images))


def _as_values(values) -> np.ndarray:
    return np.asarray([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def per_image_sums(keys: Sequence, values, images: Sequence | None = None) -> tuple[list, np.ndarray, np.ndarray]:
    """(images, sums, counts): per image, the sum of its targets' finite values and their number.

    ``keys`` names each target's image (one entry per target, parallel to ``values``); ``images`` fixes
    the image order (images absent from ``keys`` get sum 0 and count 0), by default first appearance."""
    values = _as_values(values)
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} image keys for {len(values)} values: one key per target")
    images = list(dict.fromkeys(str(k) for k in keys)) if images is None else [str(k) for k in images]
    index = {k: i for i, k in enumerate(images)}
    rows = np.asarray([index[str(k)] for k in keys], dtype=np.int64)
    finite = np.isfinite(values)
    sums = np.bincount(rows[finite], weights=values[finite], minlength=len(images))
    counts = np.bincount(rows[finite], minlength=len(images)).astype(np.float64)
    return images, sums, counts


def _percentiles(replicates: np.ndarray, confidence: float) -> list[float | None]:
    replicates = replicates[np.isfinite(replicates)]
    if not replicates.size:
        return [None, None]
    tail = 50 * (1 - confidence)
    # inverted_cdf: the interval's ends are replicate values (a margin of identical hits stays exactly 0)
    lo, hi = np.percentile(replicates, [tail, 100 - tail], method="inverted_cdf")
    return [float(lo), float(hi)]


def _ratio(resamples: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per resample: the drawn images' summed values over their number of targets (NaN: no target drawn)."""
    num, den = sums[resamples].sum(1), counts[resamples].sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def bootstrap_rate(keys: Sequence, values, *, n_boot: int = N_BOOT, seed: int = SEED,
                   confidence: float = CONFIDENCE) -> dict:
    """Mean of per-target ``values`` (hits 0/1, or a random map's hit probability) with its percentile
    interval over images. Returns ``{"value", "interval": [lo, hi], "n_targets", "n_images"}``
    (value None and interval [None, None] without any finite value)."""
    images, sums, counts = per_image_sums(keys, values)
    total = counts.sum()
    value = float(sums.sum() / total) if total else None
    if not total:
        return {"value": None, "interval": [None, None], "n_targets": 0, "n_images": 0}
    used = counts > 0
    reps = _ratio(image_resamples(int(used.sum()), n_boot, seed), sums[used], counts[used])
    return {"value": value, "interval": _percentiles(reps, confidence), "n_targets": int(total),
            "n_images": int(used.sum())}


def _paired_differences(keys: Sequence, model, baseline) -> tuple[list, np.ndarray]:
    """Keys and model − baseline of the targets where both have a value (NaN elsewhere)."""
    m, b = _as_values(model), _as_values(baseline)
    if not (len(keys) == len(m) == len(b)):
        raise ValueError(f"paired hits need one key, model and baseline value per target: "
                         f"{len(keys)} keys, {len(m)} model, {len(b)} baseline values")
    return list(keys), m - b  # NaN where either side has none


def paired_margin(keys: Sequence, model, baseline, *, n_boot: int = N_BOOT, seed: int = SEED,
                  confidence: float = CONFIDENCE) -> dict:
    """Model − baseline over the same targets, with its interval over images (both sides resampled
    together). Returns ``{"margin", "interval": [lo, hi], "n_targets", "n_images"}``."""
    keys, diff = _paired_differences(keys, model, baseline)
    r = bootstrap_rate(keys, diff, n_boot=n_boot, seed=seed, confidence=confidence)
    return {"margin": r["value"], "interval": r["interval"], "n_targets": r["n_targets"], "n_images": r["n_images"]}


def pooled_paired_margin(runs: Sequence[Mapping], model: str = "model", baseline: str = "train_prior", *,
                         n_boot: int = N_BOOT, seed: int = SEED, confidence: float = CONFIDENCE) -> dict:
    """Paired margin model − baseline pooled over seeds, with intervals over evaluation images (and seeds).

    ``runs``: one mapping per seed (training run) evaluated on the same evaluation set, each holding
    parallel per-target lists ``keys`` (image key of every target), ``runs[i][model]`` and
    ``runs[i][baseline]`` -- exactly one heatmap's block of ``eval.json``
    ``localisation.hits`` (``"mask"``, ``"mask_pathology"`` or ``"attention"``), whose baselines are
    ``"train_prior"``, ``"loo_prior"`` and ``"chance"``.

    Each seed's margin is the mean over its targets of model − baseline (its own pointing game minus its
    baseline's, on the targets both score); the pooled margin is the mean of the per-seed margins (every
    seed weighs the same, as the per-seed margins of a results table do). Every bootstrap replicate draws
    one resample of the *images* (the union of the seeds' image keys) and applies it to every seed -- the
    same images for model and baseline and for all seeds, because all seeds were evaluated on them:

    - ``interval_images``: seeds fixed, images resampled -- how much this evaluation set's sample of
      images moves the pooled margin of these trained models;
    - ``interval``: images *and* seeds resampled (seeds with replacement, independently of the images,
      on each replicate) -- both what a new training seed and what a new evaluation set would move. With
      one seed it equals ``interval_images``. This is the interval to judge a margin by; with 3-5 seeds
      the seed part of it is coarse, so read it beside the per-seed margins.
    - ``per_seed``: each seed's margin and its own image interval.

    Returns ``{"margin", "interval", "interval_images", "per_seed": [{"margin", "interval", "n_targets",
    "n_images"}], "n_seeds", "n_images", "n_boot", "confidence", "model", "baseline"}``.
    """
    if not runs:
        raise ValueError("pooled_paired_margin: no runs")
    diffs = []
    for i, run in enumerate(runs):
        missing = [k for k in ("keys", model, baseline) if k not in run]
        if missing:
            raise ValueError(f"run {i}: no {', '.join(missing)} (expected one block of eval.json "
                             "localisation.hits, e.g. hits['attention'])")
        diffs.append(_paired_differences(run["keys"], run[model], run[baseline]))
    images = list(dict.fromkeys(str(k) for keys, _ in diffs for k in keys))
    sums, counts = zip(*(per_image_sums(keys, d, images)[1:] for keys, d in diffs))
    sums, counts = np.stack(sums), np.stack(counts)  # (seeds, images)
    used = counts.sum(0) > 0
    sums, counts = sums[:, used], counts[:, used]
    n_seeds, n_images = sums.shape
    resamples = image_resamples(n_images, n_boot, seed)  # one image resample per replicate, shared by all seeds
    per_seed_reps = np.stack([_ratio(resamples, s, c) for s, c in zip(sums, counts)])  # (seeds, n_boot)
    with np.errstate(invalid="ignore", divide="ignore"):
        margins = np.where(counts.sum(1) > 0, sums.sum(1) / np.maximum(counts.sum(1), 1), np.nan)
    # seeds drawn with replacement per replicate, from a stream of their own (the image draws stay the same)
    seed_draws = np.random.default_rng([seed, 1]).integers(0, n_seeds, size=(n_seeds, n_boot))
    fixed = per_seed_reps.mean(0)  # NaN when a drawn resample left a seed without targets (then dropped)
    both = np.take_along_axis(per_seed_reps, seed_draws, axis=0).mean(0)
    per_seed = [{"margin": None if not np.isfinite(m) else float(m),
                 "interval": _percentiles(reps, confidence), "n_targets": int(c.sum()),
                 "n_images": int((c > 0).sum())} for m, reps, c in zip(margins, per_seed_reps, counts)]
    finite = margins[np.isfinite(margins)]
    return {"margin": float(finite.mean()) if finite.size == n_seeds else None,
            "interval": _percentiles(both, confidence), "interval_images": _percentiles(fixed, confidence),
            "per_seed": per_seed, "n_seeds": n_seeds, "n_images": n_images, "n_boot": n_boot,
            "confidence": confidence, "model": model, "baseline": baseline}
