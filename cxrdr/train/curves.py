"""`train curves RUN [RUN ...]`: a run's training curves from its metrics.jsonl, several runs side by side.

One panel a quantity, one colour a run, samples seen (or steps) across: the total loss and each loss term, the
validation passes' mean recall beside chance, lr, logit scale, the kept-token ratio, throughput, and each term's
gradient norm on the shared trunk (log scale: the terms differ by orders of magnitude). Reading the records and
laying out the panels (``load_run``, ``curve_panels``) is kept apart from drawing them (``plot_curves``), so what
a figure shows is tested without looking at pixels.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cxrdr.common.errors import UserError
from cxrdr.common.plots import pyplot, save_figure
from cxrdr.train.runfolder import numbered_complete_lines

# Panels in this order, then the loss terms (loss/*), then their gradient norms (grad_norm/*). A key no run logs
# gets no panel.
LEADING = ("loss", "val mean_recall", "lr", "logit_scale", "keep_ratio", "samples_per_s")
EVAL_KEY = "mean_recall"  # the validation passes' figure (retrieval over the val split), beside chance_mean_recall
# Parameters and schedules, not one step's measurement: drawn as logged whatever --smooth says.
NOT_SMOOTHED = ("val mean_recall", "lr", "logit_scale", "keep_ratio")
TITLES = {"loss": "total loss", "val mean_recall": "{split} mean recall (dashed: chance)", "lr": "learning rate",
          "logit_scale": "logit scale", "keep_ratio": "kept-token ratio", "samples_per_s": "samples/s"}


@dataclass
class RunCurves:
    """One run's logged series: ``train[key]`` and ``val[key]`` as (x, y) arrays, x in samples seen or steps."""
    label: str
    train: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    val: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    val_splits: tuple[str, ...] = ()  # the splits the validation passes read (`--eval-split`: val by default)


@dataclass
class Panel:
    key: str
    title: str
    log_y: bool
    lines: dict[str, tuple[np.ndarray, np.ndarray]]  # run label -> (x, y)
    chance: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def read_records(path: Path) -> list[dict]:
    """RUN/metrics.jsonl's records, less a last line a killed run left half-written; a damaged line is a
    UserError naming the file and the line."""
    if not path.is_file():
        raise UserError(f"{path}: no such file (a run folder written by `train run` holds one)")
    records = []
    for number, line in numbered_complete_lines(path.read_text(errors="replace")):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}, line {number}: not a JSON record ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}, line {number}: not a JSON object")
        records.append(record)
    return records


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series(records: list[dict], keys, x_of) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """key -> (x, y) over the records that log the key as a number (null, i.e. NaN, kept as a gap)."""
    out = {}
    for key in keys:
        points = [(x_of(r), np.nan if r[key] is None else float(r[key])) for r in records
                  if key in r and (r[key] is None or _numeric(r[key]))]
        if points:
            xs, ys = zip(*points)
            out[key] = (np.asarray(xs, dtype=float), np.asarray(ys, dtype=float))
    return out


def load_run(run_dir: Path, label: str, x_axis: str = "samples") -> RunCurves:
    """A run folder's curves. ``x_axis`` "samples": samples seen (a validation pass at step s is placed at the
    samples the training records give for s, interpolated between logging steps); "step": steps."""
    if x_axis not in ("samples", "step"):
        raise UserError(f"--x must be samples or step (got {x_axis!r})")
    path = Path(run_dir) / "metrics.jsonl"
    records = read_records(path)
    train = [r for r in records if r.get("kind") == "train" and _numeric(r.get("step"))]
    if not train:
        raise UserError(f"{path}: no training records yet (the first is written at the first logging step)")
    val = [r for r in records if r.get("kind") == "eval" and _numeric(r.get("step"))]
    if x_axis == "step":
        def x_of(r):
            return float(r["step"])
    elif all(_numeric(r.get("samples_seen")) for r in train):
        steps = np.asarray([r["step"] for r in train], dtype=float)
        seen = np.asarray([r["samples_seen"] for r in train], dtype=float)
        per_step = seen[-1] / max(steps[-1], 1.0)  # for a pass before the first logging step or after the last

        def x_of(r):
            if r.get("kind") != "eval":
                return float(r["samples_seen"])
            return float(np.interp(r["step"], steps, seen, left=r["step"] * per_step, right=r["step"] * per_step))
    else:
        raise UserError(f"{path}: training records without samples_seen; plot them with --x step")
    train_keys = dict.fromkeys(k for r in train for k in r if k in LEADING or k.startswith(("loss/", "grad_norm")))
    run = RunCurves(label, _series(train, train_keys, x_of))
    run.val = _series(val, (EVAL_KEY, "chance_" + EVAL_KEY), x_of)
    run.val_splits = tuple(dict.fromkeys(str(r["split"]) for r in val if "split" in r))
    return run


def run_labels(paths: list[Path]) -> list[str]:
    """Each run's shortest trailing path that tells it apart from the others (``plain/seed-0`` beside
    ``reinforced/seed-0``; the folder's name alone where names differ)."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]  # the same folder twice


def curve_panels(runs: list[RunCurves]) -> list[Panel]:
    """The figure's panels in order (``LEADING``, the loss terms, the total gradient norm, each term's), each with
    the lines of the runs that log its quantity."""
    def panel(key, title, log_y, source, name=None):
        lines = {run.label: source(run)[key] for run in runs if key in source(run)}
        return Panel(name or key, title, log_y, lines) if lines else None

    panels = []
    for key in LEADING:
        if key == "val mean_recall":
            splits = "/".join(dict.fromkeys(split for run in runs for split in run.val_splits)) or "val"
            found = panel(EVAL_KEY, TITLES[key].format(split=splits), False, lambda run: run.val, name=key)
            if found:
                found.chance = {run.label: run.val["chance_" + EVAL_KEY] for run in runs
                                if "chance_" + EVAL_KEY in run.val}
        else:
            found = panel(key, TITLES[key], False, lambda run: run.train)
        if found and not (key == "keep_ratio" and all(np.all(ys == 1.0) for _, ys in found.lines.values())):
            panels.append(found)  # a kept-token ratio of 1 throughout (no token dropped) says nothing
    keys = dict.fromkeys(k for run in runs for k in run.train)
    panels += [panel(k, k, False, lambda run: run.train) for k in keys if k.startswith("loss/")]
    grad_keys = sorted((k for k in keys if k.startswith("grad_norm")), key=lambda k: (k != "grad_norm", k))
    panels += [panel(k, k + " (log)", True, lambda run: run.train) for k in grad_keys]
    return [p for p in panels if p is not None]


def _check_smoothing(weight: float) -> None:
    if not 0 <= weight < 1:
        raise UserError(f"--smooth must be in [0, 1) (got {weight})")


def smoothed(ys: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's debiased exponential moving average: ``weight`` of the running value, ``1 - weight`` of each
    new point (0: the points as they are); a NaN point is skipped (the average carries on over it)."""
    _check_smoothing(weight)
    out, value, seen = np.full(len(ys), np.nan), 0.0, 0
    for i, y in enumerate(ys):
        if np.isfinite(y):
            value, seen = weight * value + (1 - weight) * y, seen + 1
        if seen:
            out[i] = value / (1 - weight ** seen)
    return out


def plot_curves(runs: list[RunCurves], path: Path, x_axis: str = "samples", columns: int = 4,
                smooth: float = 0.0) -> list[Panel]:
    """Draw ``curve_panels(runs)`` into one PNG at ``path``; returns the panels drawn. ``smooth`` > 0: the training
    records' series (single steps' values, so noisy) drawn as their moving average (``smoothed``) over the points
    themselves, faint; ``NOT_SMOOTHED`` as they are."""
    _check_smoothing(smooth)  # before a figure is opened
    panels = curve_panels(runs)
    plt = pyplot()
    from matplotlib.ticker import EngFormatter, MaxNLocator

    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 2.5 * rows + 0.6), squeeze=False)
    colours = {run.label: f"C{i % 10}" for i, run in enumerate(runs)}
    for ax, p in zip(axes.flat, panels):
        for label, (xs, ys) in p.lines.items():
            marker = "o" if len(xs) < 30 else None
            if smooth and p.key not in NOT_SMOOTHED:
                ax.plot(xs, ys, "-", lw=0.8, color=colours[label], alpha=0.25)
                ys, marker = smoothed(ys, smooth), None
            ax.plot(xs, ys, "-", lw=1.2, color=colours[label], marker=marker, ms=2.5)
        for label, (xs, ys) in p.chance.items():
            ax.plot(xs, ys, "--", lw=0.9, color=colours[label], alpha=0.6)
        if p.log_y and all(np.nanmin(ys) > 0 for _, ys in p.lines.values() if np.isfinite(ys).any()):
            ax.set_yscale("log")
        ax.set_title(p.title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 12k, not 12000 (five such labels run together)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("samples seen" if x_axis == "samples" else "step", fontsize=8)
    handles = [plt.Line2D([], [], color=colours[run.label], lw=2) for run in runs]
    fig.legend(handles, [run.label for run in runs], loc="upper center", ncol=min(len(runs), 4), fontsize=8,
               frameon=False)
    # fixed margins, not tight_layout: that would be one more full draw of every panel
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.5 / height, top=1 - 0.7 / height, wspace=0.3, hspace=0.45)
    save_figure(fig, path, tight=False)
    return panels
