"""What `train run --verify-checksums` (on by default) costs per training step.

    OMP_NUM_THREADS=1 python benchmarks/checksum_cost.py --shards demo/shards --model cpu-D --batch-size 32

1. ``crc_ms_per_batch``: every train sample of the folder is read from its tar (untimed), then
   timed through the check the training stream runs (``cxrdr.train.integrity.ChecksumCheck``:
   the shard's recorded CRC-32s, then one CRC-32 per member); the mean over the split, times
   ``--batch-size``. This is CPU time the data workers spend per step.
2. ``step_ms``: ``train run``'s mean step time (first step excluded) over ``--steps`` steps of
   ``--model`` with the check off, then on (same seed, same data; a shared machine makes the A/B
   difference noisy, which is why 1 is measured apart).
3. ``cost_fraction`` = crc_ms_per_batch / step_ms (check off): the share of a step the check adds
   at most, i.e. if the workers were the bottleneck and every CRC cycle were on the critical path.

Prints one JSON object (and writes it to ``--out`` when given).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cxrdr.common.shards import iter_tar_samples  # noqa: E402
from cxrdr.train.data import split_shards  # noqa: E402
from cxrdr.train.integrity import ChecksumCheck  # noqa: E402
from cxrdr.train.loop import train  # noqa: E402


def crc_cost(shards: Path, repeats: int = 3) -> dict:
    """Mean seconds of the training check per train sample, and the sample's bytes."""
    urls, _ = split_shards(shards, "train")
    samples = [{"__key__": key, "__url__": url, **parts} for url in urls for key, parts in iter_tar_samples(url)]
    best = float("inf")
    for _ in range(repeats):  # the best of a few passes: the least disturbed by the other processes
        check = ChecksumCheck()
        t0 = time.perf_counter()
        for sample in samples:
            check(sample)
        best = min(best, time.perf_counter() - t0)
    size = sum(len(v) for s in samples for k, v in s.items() if not k.startswith("__"))
    return {"samples": len(samples), "bytes_per_sample": round(size / len(samples)),
            "crc_us_per_sample": round(1e6 * best / len(samples), 2)}


def step_ms(shards: Path, model: str, batch_size: int, steps: int, workers: int, verify: bool) -> float:
    with tempfile.TemporaryDirectory() as out:
        summary = train(dict(shards=str(shards), model=model, batch_size=batch_size, steps=steps, workers=workers,
                             out=out, device="cpu", progress=False, save_every=0, eval_every=0,
                             eval_max_samples=32, verify_checksums=verify))
    return float(summary["mean_step_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--model", default="cpu-D")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="Steps of each timed run (0: CRC cost only).")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"shards": str(args.shards), "model": args.model, "batch_size": args.batch_size,
              **crc_cost(args.shards)}
    result["crc_ms_per_batch"] = round(result["crc_us_per_sample"] * args.batch_size / 1000, 3)
    if args.steps:
        off = step_ms(args.shards, args.model, args.batch_size, args.steps, args.workers, False)
        on = step_ms(args.shards, args.model, args.batch_size, args.steps, args.workers, True)
        result.update(step_ms_check_off=off, step_ms_check_on=on,
                      cost_fraction=round(result["crc_ms_per_batch"] / off, 5))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
