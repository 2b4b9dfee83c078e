"""A real training run with the default CUDA graphs beside the same run eager: do they end alike?

The graphs' own check (``block_graphs_check.py``) compares one tower's outputs and gradients after a few steps. A
run has more: logging steps (which run eagerly), validation passes between steps, E's keep-rate warm-up, the loss
balance, checkpoints. On the sixth GPU lease every graphed run went NaN at its first logging step, which no tower
check could see (docs/gpu.md). This trains one seed twice, with ``--cuda-graphs auto --cuda-graphs-text auto``
(the default: the image tower's blocks and the text tower's layers) and with both ``off``, then prints each logged
loss of both, their largest relative difference, and what each run captured (summary.json's ``cuda_graphs``).
Off CUDA both runs are eager, so their losses must be equal (the CPU check the tests run).

    python benchmarks/graphs_real_run.py --device cuda      # D, 60 steps of 256, phantom:1024 at 256 px, ~1 min
    python benchmarks/graphs_real_run.py --device cuda --heads --model E   # the heads on the patch grid graphed too
    python benchmarks/graphs_real_run.py --model tiny-E --steps 6 --batch-size 4 --n 48 --store-size 64  # CPU

Exit status 1 when a run logs a non-finite loss, or stops on one.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

SETTINGS = {"graphs": {"cuda_graphs": "auto", "cuda_graphs_text": "auto"},
            "eager": {"cuda_graphs": "off", "cuda_graphs_text": "off"}}


def logged_losses(run_dir: Path) -> dict[int, float]:
    """Step -> total loss of each training record in RUN/metrics.jsonl (a stopped run's unfinished line left out)."""
    from cxrdr.train.runfolder import complete_lines

    rows = (json.loads(line) for line in complete_lines((run_dir / "metrics.jsonl").read_text()))
    return {row["step"]: row["loss"] for row in rows if row.get("kind") == "train"}


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def run_pair(shards: Path, out: Path, model: str, steps: int, batch_size: int, device: str, workers: int,
             heads: bool = False, losses: bool = False) -> dict:
    """Train the graphed and the eager run of one seed; their losses, what they captured and how they compare.
    ``heads``: the graphed run replays the heads on the patch grid too (``--cuda-graphs-heads on``), and both runs
    anneal the Top-K mask over their first quarter (a graph holds the final K only: over the default 2,000 steps'
    anneal a short run would never capture one). ``losses``: the graphed run replays the CLIP and distillation terms
    too (``--cuda-graphs-losses on``)."""
    from cxrdr.train.loop import train

    runs = {}
    for name, settings in SETTINGS.items():
        if heads:
            settings = {**settings, "cuda_graphs_heads": "on" if name == "graphs" else "off",
                        "model_overrides": {"k_anneal_steps": max(1, steps // 4)}}
        if losses:
            settings = {**settings, "cuda_graphs_losses": "on" if name == "graphs" else "off"}
        cfg = {"shards": str(shards), "model": model, "out": str(out / name), "steps": steps,
               "batch_size": batch_size, "seed": 0, "device": device, "workers": workers, "progress": False,
               "log_every": max(1, steps // 6), "eval_every": max(1, steps // 2), "overwrite": True, **settings}
        try:
            summary = train(cfg)
            error = None
        except Exception as exc:  # noqa: BLE001 - a run that stops (a non-finite loss) is this check's finding
            summary, error = {}, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        runs[name] = {"losses": logged_losses(out / name) if (out / name / "metrics.jsonl").is_file() else {},
                      "cuda_graphs": summary.get("cuda_graphs"), "error": error}
    steps_both = sorted(set(runs["graphs"]["losses"]) & set(runs["eager"]["losses"]))
    pairs = [(s, runs["graphs"]["losses"][s], runs["eager"]["losses"][s]) for s in steps_both]
    finite = all(math.isfinite(v) for r in runs.values() for v in r["losses"].values())
    return {"model": model, "steps": steps, "batch_size": batch_size, "device": device, "runs": runs,
            "pairs": pairs, "largest_relative_difference": max((relative_difference(g, e) for _, g, e in pairs),
                                                              default=None),
            "ok": finite and not any(r["error"] for r in runs.values())}


def report(result: dict) -> str:
    lines = [f"{result['model']}, {result['steps']} steps of {result['batch_size']} on {result['device']}, seed 0: "
             "the default graphs beside eager", "", "| step | loss, graphs | loss, eager | relative difference |",
             "|---|---|---|---|"]
    lines += [f"| {s} | {g:.4f} | {e:.4f} | {relative_difference(g, e):.1e} |" for s, g, e in result["pairs"]]
    largest = result["largest_relative_difference"]
    lines += ["", f"largest relative difference: {'-' if largest is None else f'{largest:.2e}'}"]
    for name, run in result["runs"].items():
        lines.append(f"{name}: captured {json.dumps(run['cuda_graphs'])}"
                     + (f"; STOPPED: {run['error']}" if run["error"] else ""))
    lines.append("every loss finite, both runs finished" if result["ok"] else "FAILED: a non-finite loss or a stop")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import build_phantom

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="D")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--n", type=int, default=1024, help="phantom studies to build (ignored with --shards)")
    parser.add_argument("--store-size", type=int, default=256)
    parser.add_argument("--shards", help="an existing shard folder instead of a phantom build")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workers", type=int, default=0, help="the runs' loader workers (and the build's)")
    parser.add_argument("--heads", action="store_true",
                        help="the graphed run replays the heads on the patch grid too (--cuda-graphs-heads on)")
    parser.add_argument("--losses", action="store_true",
                        help="the graphed run replays the CLIP and distillation terms too (--cuda-graphs-losses on)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="graphs-real-run-") as tmp:
        shards = Path(args.shards) if args.shards else build_phantom(Path(tmp) / "shards", args.n, args.store_size,
                                                                     args.workers)
        result = run_pair(shards, Path(tmp), args.model, args.steps, args.batch_size, args.device, args.workers,
                          args.heads, args.losses)
    print(report(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
