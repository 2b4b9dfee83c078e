"""Milliseconds a training batch takes to load in the step's own process (``--workers 0``, as the demo's runs),
with the batch's views replayed one at a time or together in the collate, with the DataLoader's default
``default_convert`` pass or none, and with the shards read whole kept in memory for later rounds or not.

    python benchmarks/data_path.py demo/shards --model cpu-D --batch-size 32 --batches 40 --rounds 3
    python benchmarks/data_path.py SHARDS --model D --batch-size 256 --workers 14   # a GPU host's loader, samples/s

Each configuration reads the same stream (seed 0, the train split, the shards' teachers) from its start (the
kept shards fill in its first round: ask more batches than the split has for their gain); the rounds alternate
the configurations so they see the same box. The batches of every configuration are checked equal to the first
one's (images bit for bit, texts, teacher rows): a faster path that changed what a step sees would be no gain.
The demo's ``train run`` logs the same wait per step as ``data_time_ms``.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data._utils.collate import default_convert  # noqa: E402

from cxrdr.train.data import already_collated, training_parts  # noqa: E402
from cxrdr.train.integrity import CorruptPolicy  # noqa: E402
from cxrdr.train.models import build_student  # noqa: E402
from cxrdr.train.models.config import StudentConfig  # noqa: E402
from cxrdr.train.stream import StreamState, TrainStream  # noqa: E402

# name -> (views replayed in the collate, the DataLoader's collate_fn, MB of shards kept in memory)
CONFIGURATIONS = {
    "one view at a time, default_convert": (False, default_convert, 0),
    "views together, default_convert": (True, default_convert, 0),
    "views together, no convert": (True, already_collated, 0),
    "and the shards kept in memory (cxrdr's loaders)": (True, already_collated, 256),
}


def loader(parts, batch_size: int, together: bool, collate_fn, memory_mb: int, workers: int = 0) -> DataLoader:
    parts = dataclasses.replace(parts, view=dataclasses.replace(parts.view, replay_in_collate=together))
    stream = TrainStream(parts, batch_size, StreamState(workers), seed=0, shuffle_buffer=256, rank=0, world=1,
                         policy=CorruptPolicy(), verify_checksums=True, shard_memory_mb=memory_mb)
    return DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=collate_fn,
                      prefetch_factor=2 if workers else None)


def read(batches, n: int) -> tuple[float, list[dict]]:
    """(seconds for n batches after the first, the n batches)."""
    it = iter(batches)
    next(it)  # the shuffle buffer's first fill
    t0 = time.perf_counter()
    got = [next(it) for _ in range(n)]
    return time.perf_counter() - t0, got


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif key == "teacher":
            if any(not torch.equal(x[t][p], y[t][p]) for t in x for p in x[t] if x[t][p] is not None):
                return False
        elif key not in ("stream", "image_wh") and x != y:  # default_convert turns tuples into lists
            return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards")
    parser.add_argument("--model", default="cpu-D", help="the student whose image size and tokenizer the stream uses")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0,
                        help="loader worker processes (0: the step's own; N: what N workers deliver, e.g. a GPU host's "
                             "`train run` default, its cores but two)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    student = build_student(StudentConfig.from_yaml(args.model))
    parts = training_parts(args.shards, "train", student)
    times: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    first: list[dict] | None = None
    for _ in range(args.rounds):
        for name, (together, collate_fn, memory_mb) in CONFIGURATIONS.items():
            seconds, batches = read(loader(parts, args.batch_size, together, collate_fn, memory_mb, args.workers),
                                    args.batches)
            times[name].append(seconds / args.batches * 1e3)
            if first is None:
                first = batches
            elif not all(same(a, b) for a, b in zip(first, batches)):
                print(f"{name}: its batches differ from the first configuration's", file=sys.stderr)
                return 1
    print(f"{args.shards}, {args.model} at {student.image_size} px, batch {args.batch_size}, {args.batches} batches "
          f"x {args.rounds} rounds, {args.threads} threads, {args.workers or 'no'} loader workers; every "
          f"configuration's batches equal")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"  {name:<48} {ms:6.1f} ms a batch, {args.batch_size / ms * 1e3:7.0f} samples/s (rounds: "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
