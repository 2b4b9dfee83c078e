"""The frozen stem's memo (``cxrdr/train/models/frozen_memo.py``), on and off in one training run.

    python benchmarks/frozen_memo_ab.py --shards demo/shards                  # cpu-D, batch 32, the demo's shards
    python benchmarks/frozen_memo_ab.py --shards S --model tiny-cnn-D --blocks 8

One trainer steps ``--warmup`` steps, then ``--blocks`` blocks of ``--block`` steps (``Trainer.train_step``, non-log
steps) with its memo on and off in the order on, off, off, on, ... (a drifting box weighs on both alike); off is the
memo ``suspended``, the frozen layers running on the whole batch as without one. The same process, weights and data
stream for both, unlike two runs taken in turn (which differ by the box's drift between them) or the step
benchmark's trainers taking turns (``train_step.py --without-memo``). Prints the mean ms a step of each and the
memo's hits.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]


def memo_on(block: int) -> bool:
    """On, off, off, on, on, off, off, on, ...: each setting as often early as late."""
    return block % 4 in (0, 3)


def measure(trainer, warmup: int, blocks: int, block: int) -> dict:
    """Mean ms a step with the memo on and off, over alternating blocks of ``block`` steps."""
    from cxrdr.train.models.frozen_memo import suspended

    batches = trainer._batches()
    for _ in range(warmup):
        trainer.train_step(batches, log_balance=False)
    seconds = {True: 0.0, False: 0.0}
    steps = {True: 0, False: 0}
    for b in range(blocks):
        on = memo_on(b)
        start = time.perf_counter()
        with contextlib.nullcontext() if on else suspended(trainer.student):
            for _ in range(block):
                trainer.train_step(batches, log_balance=False)
        seconds[on] += time.perf_counter() - start
        steps[on] += block
    return {"on_ms": 1000 * seconds[True] / max(steps[True], 1), "off_ms": 1000 * seconds[False] / max(steps[False], 1),
            "memo": [memo.describe() for memo in trainer.memos]}


def main(argv=None) -> int:
    import torch

    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True)
    parser.add_argument("--model", default="cpu-D")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(shards=args.shards, model=args.model, batch_size=args.batch_size, workers=0, device="cpu",
                          steps=args.warmup + args.blocks * args.block, eval_every=0, progress=False, out=out)
        trainer = Trainer(cfg)
        if not trainer.memos:
            raise SystemExit(f"{args.model} has no frozen layers with a memo here (cpu-* and tiny-cnn-* students, "
                             "reinforced runs on the CPU)")
        result = measure(trainer, args.warmup, args.blocks, args.block)
    hits = sum(m["hits"] for m in result["memo"])
    rows = hits + sum(m["misses"] for m in result["memo"])
    print(f"{args.model}, batch {args.batch_size}, {args.threads} thread(s), {args.blocks} blocks of {args.block} "
          f"steps after {args.warmup}: memo on {result['on_ms']:.1f} ms a step, off {result['off_ms']:.1f} ms "
          f"({result['off_ms'] - result['on_ms']:+.1f} ms); memo hits {hits} of {rows} rows while on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
