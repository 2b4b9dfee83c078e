"""A GPU host's small CPU work (an evaluation's or a validation pass's retrieval and probe) on one thread and on
every thread, alone and beside busy processes (loader workers, a second copy): ``cxrdr.common.host_threads``.

    python benchmarks/host_threads.py --busy 0,2 --rows 512 --rounds 10

Each busy process spins on one core for the whole measurement. Prints the median seconds of each case and the
ratio of every-thread to one-thread time.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]


def spin(stop) -> None:
    while not stop.is_set():
        pass


def host_work(rows: int, rng) -> None:
    """The retrieval metrics and a quick probe on ``rows`` embeddings: what a pass does on the host."""
    from cxrdr.train.evaluation.retrieval import retrieval_metrics
    from cxrdr.train.quick_eval import quick_probe

    img, txt = rng.normal(size=(rows, 384)).astype("float32"), rng.normal(size=(rows, 384)).astype("float32")
    retrieval_metrics(img, txt, texts=[f"report {i % (rows - 10)}" for i in range(rows)])
    labels = (rng.random((rows, 14)) < 0.3).astype("float32")
    quick_probe(img, labels, [f"s{i // 2}" for i in range(rows)])


def median_seconds(threads: int, rows: int, rounds: int) -> float:
    import numpy as np

    from cxrdr.common.host_threads import host_threads

    rng = np.random.default_rng(0)
    times = []
    with host_threads(threads):
        host_work(rows, rng)  # first-call costs
        for _ in range(rounds):
            start = time.perf_counter()
            host_work(rows, rng)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", default="0,2", help="busy processes beside, comma-separated cases")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    every = torch.get_num_threads()
    print(f"{args.rows} rows: retrieval + quick probe, median of {args.rounds}; torch's threads here: {every}")
    print("| busy processes beside | 1 thread (s) | every thread (s) | every / 1 |\n|---|---|---|---|")
    for busy in (int(b) for b in args.busy.split(",")):
        stop = mp.Event()
        spinners = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            one, all_ = median_seconds(1, args.rows, args.rounds), median_seconds(every, args.rows, args.rounds)
        finally:
            stop.set()
            for p in spinners:
                p.join()
        print(f"| {busy} | {one:.4f} | {all_:.4f} | {all_ / one:.1f}x |")


if __name__ == "__main__":
    main()
