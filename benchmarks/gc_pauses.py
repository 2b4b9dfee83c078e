"""Garbage-collection pauses in the training loop's steps, with the heap as it is and frozen (``cxrdr.common.heap``).

    python benchmarks/gc_pauses.py --model tiny-A --trainers 1 --steps 300 --batch-size 64

Builds a small phantom shard folder, makes ``--trainers`` trainers (the GPU suite's loop section keeps eight
alive), and steps the first one ``--steps`` times (``Trainer.train_step``, non-log steps) twice: with the heap as
it is, then inside ``frozen_heap()`` as ``Trainer.run`` steps. ``gc.callbacks`` times every collection; the
printout gives, per generation, how many ran, their total and longest ms, beside the mean step. A collection
of the oldest generation walks every tracked object in the process (the count is printed), so its pause grows
with what the process holds, not with the step.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


class CollectionTimer:
    """Every collection's generation and ms, from ``gc.callbacks``."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], 1000 * (time.perf_counter() - self._start)))

    def summary(self) -> str:
        parts = []
        for generation in (0, 1, 2):
            ms = [p for g, p in self.pauses if g == generation]
            parts.append(f"gen{generation} {len(ms)} x, {sum(ms):.1f} ms, longest {max(ms, default=0):.1f} ms")
        return "; ".join(parts)


def run_steps(trainer, batches, steps: int, timer: CollectionTimer) -> float:
    """Mean ms per step over ``steps`` steps, the collections timed."""
    timer.pauses.clear()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batches, log_balance=False)
    return 1000 * (time.perf_counter() - start) / steps


def main(argv=None) -> int:
    import torch

    import train_step
    from cxrdr.common.heap import frozen_heap

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-A")
    parser.add_argument("--trainers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="cxrdr-gc-") as tmp:
        shards = train_step.build_phantom(Path(tmp) / "shards", 64, 64)
        base = train_step.bench_config(str(shards), args.batch_size, 0, "cpu", amp="none")
        trainers = [train_step.make_trainer(base, model=args.model, out=f"{tmp}/run-{i}") for i in range(args.trainers)]
        trainer, batches = trainers[0]
        for _ in range(3):  # first steps: the optimiser's state, the allocator
            trainer.train_step(batches, log_balance=False)
        timer = CollectionTimer()
        gc.callbacks.append(timer)
        try:
            as_is = run_steps(trainer, batches, args.steps, timer)
            print(f"heap as it is ({len(gc.get_objects())} tracked objects): {as_is:.1f} ms a step; {timer.summary()}")
            with frozen_heap():
                frozen = run_steps(trainer, batches, args.steps, timer)
                tracked = len(gc.get_objects())
            print(f"heap frozen ({tracked} tracked objects): {frozen:.1f} ms a step; {timer.summary()}")
        finally:
            gc.callbacks.remove(timer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
