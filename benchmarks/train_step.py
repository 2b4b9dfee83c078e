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

    python benchmarks/train_step.py                      # the CPU ladder, phantom shards, CPU/GPU auto
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

    cmd = [sys.executable, "-m", "cxrdr.reinforce.cli", "build", "--source", f"phantom:{n}", "--teachers", "random:tiny",
           "--n-aug", "4", "--n-captions", "3", "--store-size", str(store_size), "--workers", "0",
           "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def make_trainer(base: dict, **overrides):
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer

    trainer = Trainer(TrainConfig.load(None, **{**base, **overrides}))
    # time the student as trained: token dropping (E) and Top-K at their target rates, not in warm-up
    trainer.step = trainer.student.config.warmup_steps_to_target
    return trainer, trainer._batches()


def time_round_robin(trainers: dict, steps: int, warmup: int) -> list[dict]:
    """Mean ms per optimiser step of each configuration, steps interleaved round-robin.

    Interleaving makes every configuration see the same background load (shared machines), so
    the ratios stay meaningful even when absolute times drift. The first `warmup` steps of each
    are untimed (start-up costs: worker start, allocator, autotuning); the slowest 10% dropped.
    """
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = {name: [] for name in trainers}
    data = {name: [] for name in trainers}
    teacher = {name: [] for name in trainers}
    for round_ in range(warmup + steps):
        for name, (trainer, batches) in trainers.items():
            sync()
            t0 = time.perf_counter()
            result = trainer.train_step(batches, log_balance=False)
            sync()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - t0)
                data[name].append(result["data_time"])
                teacher[name].append(result["teacher_time"])
    out = []
    for name, (trainer, _) in trainers.items():
        t = sorted(times[name])
        trimmed = t[: max(1, int(len(t) * 0.9))]
        cfg = trainer.cfg
        out.append({"name": name, "model": cfg.model, "mode": cfg.mode, "online_teacher": cfg.online_teacher,
                    "step_ms": 1000 * sum(trimmed) / len(trimmed), "median_ms": 1000 * t[len(t) // 2],
                    "data_ms": 1000 * sum(data[name]) / len(data[name]),
                    "teacher_ms": 1000 * sum(teacher[name]) / len(teacher[name]), "batch_size": cfg.batch_size,
                    "device": str(trainer.device)})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", help="shard folder (default: a phantom build in a temp folder)")
    parser.add_argument("--size", choices=("cpu", "tiny", "full"), default="cpu",
                        help="cpu-A/E/D (the CPU ladder), tiny-A/E/D (test-sized) or A/E/D (GPU-sized) students")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--teachers", default="random:tiny",
                        help="online teacher specs to time (comma list); ones that fail to load are skipped")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    parser.add_argument("--json-out", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    from cxrdr.common.allocator import keep_freed_memory

    keep_freed_memory()  # as the train CLI does
    if args.device in ("auto", "cpu") and not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="cxrdr-bench-")
    shards = Path(args.shards) if args.shards else build_phantom(Path(tmp.name) / "shards", 96, 128)
    prefix = {"cpu": "cpu-", "tiny": "tiny-", "full": ""}[args.size]
    base = dict(shards=str(shards), batch_size=args.batch_size, workers=args.workers, device=args.device,
                amp=args.amp, steps=10_000, progress=False, out=str(Path(tmp.name) / "run"),
                eval_every=0, **{"optim.warmup_steps": 1})

    plan = [("A stored", dict(model=f"{prefix}A")),
            ("E stored", dict(model=f"{prefix}E")),
            ("D stored", dict(model=f"{prefix}D")),
            ("D plain (no teacher)", dict(model=f"{prefix}D", mode="plain"))]
    for spec in [s.strip() for s in args.teachers.split(",") if s.strip()]:
        plan.append((f"D online {spec}", dict(model=f"{prefix}D", online_teacher=spec)))
    trainers = {}
    for name, overrides in plan:
        try:
            trainers[name] = make_trainer({**base, "out": str(Path(tmp.name) / f"run{len(trainers)}")},
                                          **overrides)
        except Exception as exc:  # e.g. a teacher without local weights: say so and go on
            print(f"skipped {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    results = time_round_robin(trainers, args.steps, args.warmup)

    ref = next((r["step_ms"] for r in results if r["name"] == "D stored"), None)
    print(f"\ntrain step time ({results[0]['device'] if results else '?'}, batch {args.batch_size}, "
          f"{args.size} students, mean of {args.steps} interleaved steps after {args.warmup} warm-up, slowest 10% dropped)")
    print(f"{'configuration':<30} {'ms/step':>9} {'data ms':>8} {'teacher ms':>10} {'x D stored':>10}")
    for r in results:
        ratio = f"{r['step_ms'] / ref:10.2f}" if ref else "         -"
        print(f"{r['name']:<30} {r['step_ms']:9.1f} {r['data_ms']:8.1f} {r['teacher_ms']:10.1f} {ratio}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
