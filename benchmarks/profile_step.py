"""Kernel-time profile of the real training step (``Trainer.train_step``) per student variant.

    python benchmarks/profile_step.py --shards SHARDS --out-dir DIR [--models A,D,E] [--batch-size 256]

Writes ``profile-<model>.txt`` per model: torch.profiler's operator table over a few steps (after
warm-up steps), sorted by total CUDA time, then by self CUDA time. This is what
benchmarks/results/profiles/ holds; read it beside the suite's loop section (``gpu_suite.py``) to
see where a variant's extra step time goes. On CPU it profiles CPU time (slow, for a check only).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def profile_model(model: str, shards: str, batch_size: int, device: str, warmup: int, steps: int,
                  workers: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    import train_step

    base = train_step.bench_config(shards, batch_size, workers, device)
    with tempfile.TemporaryDirectory(prefix="profile-step-") as out:
        trainer, batches = train_step.make_trainer({**base, "out": out}, model=model)
        try:
            cuda = trainer.device.type == "cuda"
            sync = train_step.sync_fn(trainer.device)
            for _ in range(warmup):
                trainer.train_step(batches, log_balance=False)
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    trainer.train_step(batches, log_balance=False)
                sync()
        finally:
            batches.close()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    averages = prof.key_averages()
    return (f"{model}: {steps} steps of batch {batch_size} on {device} after {warmup} warm-up steps\n"
            + averages.table(sort_by=key, row_limit=45, max_name_column_width=70) + "\n"
            + averages.table(sort_by="self_" + key, row_limit=45, max_name_column_width=70))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, help="a reinforce build's shard folder")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--models", default="A,D,E")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for model in [m for m in args.models.split(",") if m]:
        path = out / f"profile-{model}.txt"
        path.write_text(profile_model(model, args.shards, args.batch_size, args.device, args.warmup, args.steps,
                                      args.workers))
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
