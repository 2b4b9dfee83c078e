"""Reproducing an experiment: which results fields are measurements of the machine, and which code made a result.

Two runs of one recipe from empty folders, on the same code, give the same ``results.json`` except for the
fields below: wall-clock timings, speeds derived from them and memory measurements (issue 37, part 6;
tests/test_reproducible.py). Everything else (losses, curves, every quality figure, samples, bars on
quality) is a function of the recipe and the code.

What does change a result is the code: a change "exact to rounding" still changes the float rounding of the
first step, and 100 steps amplify it into a different final AUC. Between the NIH results (20d0d7f) and today
two commits did so (measured on the recipe's twins: d4f941d, the text tower skipping unused padding, and
77c3dda, the step without host reads). So do torch's CPU threads (recipe ``threads``). Runs, teachers and
shards are reused when their config matches, whatever code made them, so a results file may mix runs of
several code versions; every run summary, teacher record and results file therefore records
``code_version()`` (run summaries their ``torch_threads`` too), and a reused run made by another version is
named on stderr.

``python -m cxrdr.experiments.repro A/results.json B/results.json`` lists the fields that differ beyond
the measured ones (exit 1 if any); it compares two runs' ``eval.json`` or ``benchmark.json`` the same way.
"""
from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version as package_version
from pathlib import Path

# Keys (anywhere in results.json) whose values measure the machine, not the computation: seconds, ms,
# images/s and MB, which change from run to run with the load of a shared box. A key also counts with the
# per-seed suffixes the summaries add (``wall_s_seeds``, ``step_ms_sd`` ...).
TIMING_KEYS = frozenset({
    # training loop summaries, teacher records, table rows
    "wall_s", "earlier_wall_s", "train_time_s", "mean_step_ms", "eval_time_s", "step_ms", "train_img_per_s",
    "train_wall_s", "train_step_ms", "add_teacher_seconds",
    # the interleaved step benchmark and the break-even built on it
    "bench_step_ms", "online_step_ms", "stored_step_ms", "saving_per_run_s", "break_even_runs",
    # one-off teacher seconds and the build's speed (dataset.json timings)
    "add_teacher_s", "build_teacher_s", "total_s", "build_samples_per_s",
    # the teachers' training + embedding seconds, and the step ratios (benchmark's, the runs' own) over plain's
    "teacher_train_wall_s", "teacher_compute_s", "run_step_ms", "bench_ratio", "runs_ratio",
    # `train eval`'s cost block (cxrdr.train.evaluation.efficiency) and its own seconds (eval.json,
    # benchmark.json), the loop's per-log timings (metrics.jsonl)
    "inference_img_per_s", "latency_ms", "synthetic_train_img_per_s", "latency_ms_per_img",
    "eval_seconds", "seconds", "data_time_ms", "step_time_ms", "samples_per_s", "eval_phase_s",
})
MEMORY_KEYS = frozenset({"peak_memory_mb", "step_memory_delta_mb",  # measured, not timings, also excluded
                         "inference_peak_memory_mb", "memory_before_model_mb"})
MEASURED_KEYS = TIMING_KEYS | MEMORY_KEYS
_SUFFIXES = ("", "_seeds", "_sd", "_ci", "_mean")
# the bars judged on step times (their value and verdict are timings too); every quality bar is compared
TIMED_BAR_WORDS = ("step",)


def is_measured(key: str) -> bool:
    return any(key == base + suffix for base in MEASURED_KEYS for suffix in _SUFFIXES)


def comparable(result):
    """``result`` without the measured fields: what two runs of one recipe on one code version must share."""
    if isinstance(result, dict):
        if isinstance(result.get("bar"), str) and any(w in result["bar"] for w in TIMED_BAR_WORDS):
            return {"bar": result["bar"]}
        return {k: comparable(v) for k, v in result.items() if not is_measured(str(k))}
    if isinstance(result, list):
        return [comparable(v) for v in result]
    return result


def differences(a, b, path: str = "") -> list[str]:
    """Paths where two comparable results differ (to the digit: floats compared exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'first' if k in a else 'second'}")
            else:
                out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return []  # an undefined figure (NaN: no box to point at) is the same result in both
    return [f"{path}: {a!r} != {b!r}"]


def code_version() -> dict:
    """The code that computes: the git commit of the checkout cxrdr runs from and whether its tracked
    cxrdr/ or configs/ differ from it; an installed wheel (no git checkout) gives its package version."""
    return dict(_code_version())


@functools.lru_cache(maxsize=1)  # one process runs one checkout's code: ask git once
def _code_version() -> dict:
    root = Path(__file__).resolve().parents[2]
    version = {"package": _package_version()}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return version
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", "cxrdr", "configs"],
                               capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return version
    return {**version, "commit": commit.stdout.strip(), "dirty": dirty.returncode != 0}


def _package_version() -> str | None:
    try:
        return package_version("cxrdr")
    except PackageNotFoundError:
        return None


def note_other_code(what: str, recorded: dict | None, current: dict | None = None) -> bool:
    """Say on stderr when a reused unit (run, teacher) was made by other code than this one; True if so."""
    current = current or code_version()
    if recorded is None or recorded == current:
        if recorded is None:
            print(f"note: {what} is reused; it records no code version (made before they were recorded)",
                  file=sys.stderr)
        return recorded is None
    print(f"note: {what} is reused, made by code {_short(recorded)}; this is {_short(current)}: its numbers "
          f"are that code's", file=sys.stderr)
    return True


def _short(v: dict) -> str:
    c = v.get("commit")
    return (c[:7] + ("+changes" if v.get("dirty") else "")) if c else f"package {v.get('package')}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m cxrdr.experiments.repro A/results.json B/results.json", file=sys.stderr)
        return 2
    a, b = (comparable(json.loads(Path(p).read_text())) for p in argv)
    diff = differences(a, b)
    print("\n".join(diff) if diff else "same results (measured fields excluded)")
    return 1 if diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
