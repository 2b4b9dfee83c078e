"""Training step time: student variants and the cost of where the teacher signal comes from.

Measures, in one process and on the same shards, the mean wall time of one optimiser step
(data loading + forward + losses + backward + AdamW) for
  * variants A and E (reinforced: stored-embedding distillation),
  * variant D with stored embeddings (the reinforced dataset), with no teacher (plain CLIP on
    fresh augmentations) and with the teacher in the loop (online: the teacher embeds the same
    replayed crop and the report/caption every step), for each online teacher spec given
    (`random:tiny` always; others such as `biomedclip` when their weights load),
and prints them with ratios to "D stored". The interesting ratio is online / stored: what
storing the teacher's embeddings saves per step (MobileCLIP's argument).

    python benchmarks/train_step.py                      # tiny students, phantom shards, CPU/GPU auto
    python benchmarks/train_step.py --size full --shards shards/ --device cuda --teachers random:tiny,biomedclip
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def build_phantom(out: Path, n: int, store_size: int) -> Path:
    import subprocess

    cmd = [sys.executable, "-m", "reinforce.cli", "build", "--source", f"phantom:{n}", "--teachers", "random:tiny",
           "--n-aug", "4", "--n-captions", "3", "--store-size", str(store_size), "--workers", "0",
           "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def time_config(name: str, base: dict, steps: int, warmup: int, **overrides) -> dict:
    """Mean ms per optimiser step after `warmup` untimed steps (first steps pay start-up costs)."""
    import torch

    from train.config import TrainConfig
    from train.loop import Trainer

    cfg = TrainConfig(**{**base, **overrides})
    trainer = Trainer(cfg)
    batches = trainer._batches()
    for _ in range(warmup):
        trainer.train_step(batches, log_balance=False)
    sync = (lambda: torch.cuda.synchronize()) if trainer.device.type == "cuda" else (lambda: None)
    sync()
    times, data = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = trainer.train_step(batches, log_balance=False)
        sync()
        times.append(time.perf_counter() - t0)
        data.append(result["data_time"])
    times.sort()
    trimmed = times[: max(1, int(len(times) * 0.9))]  # drop the slowest 10% (other processes' noise)
    return {"name": name, "model": cfg.model, "mode": cfg.mode, "online_teacher": cfg.online_teacher,
            "step_ms": 1000 * sum(trimmed) / len(trimmed), "median_ms": 1000 * times[len(times) // 2],
            "data_ms": 1000 * sum(data) / len(data), "batch_size": cfg.batch_size,
            "device": str(trainer.device)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", help="shard folder (default: a phantom build in a temp folder)")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny",
                        help="tiny-A/E/D (CPU-sized) or A/E/D (GPU-sized) student configs")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--teachers", default="random:tiny",
                        help="online teacher specs to time (comma list); ones that fail to load are skipped")
    parser.add_argument("--json-out", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    if args.device in ("auto", "cpu") and not torch.cuda.is_available():
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    tmp = tempfile.TemporaryDirectory(prefix="cxrdr-bench-")
    shards = Path(args.shards) if args.shards else build_phantom(Path(tmp.name) / "shards", 96, 128)
    prefix = "tiny-" if args.size == "tiny" else ""
    base = dict(shards=str(shards), batch_size=args.batch_size, workers=args.workers, device=args.device,
                amp=args.amp, steps=10_000, progress=False, out=str(Path(tmp.name) / "run"),
                eval_every=0, warmup_steps=1)

    results = []
    plan = [("A stored", dict(model=f"{prefix}A")),
            ("E stored", dict(model=f"{prefix}E")),
            ("D stored", dict(model=f"{prefix}D")),
            ("D plain (no teacher)", dict(model=f"{prefix}D", mode="plain"))]
    for spec in [s.strip() for s in args.teachers.split(",") if s.strip()]:
        plan.append((f"D online {spec}", dict(model=f"{prefix}D", online_teacher=spec)))
    for name, overrides in plan:
        try:
            results.append(time_config(name, base, args.steps, args.warmup, **overrides))
        except Exception as exc:  # a teacher without local weights: say so and go on
            print(f"skipped {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        r = results[-1]
        print(f"  {name:<28} {r['step_ms']:9.1f} ms/step", file=sys.stderr)

    ref = next((r["step_ms"] for r in results if r["name"] == "D stored"), None)
    print(f"\ntrain step time ({results[0]['device'] if results else '?'}, batch {args.batch_size}, "
          f"{args.size} students, mean of {args.steps} steps after {args.warmup} warm-up, slowest 10% dropped)")
    print(f"{'configuration':<30} {'ms/step':>9} {'data ms':>8} {'x D stored':>10}")
    for r in results:
        ratio = f"{r['step_ms'] / ref:10.2f}" if ref else "         -"
        print(f"{r['name']:<30} {r['step_ms']:9.1f} {r['data_ms']:8.1f} {ratio}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
