"""add-teacher's samples/s with and without loader workers (``reinforce add-teacher --workers``).

    python benchmarks/add_teacher.py --n 1000 --workers 0,1 --torch-threads 1
    python benchmarks/add_teacher.py --n 20000 --shard-size 1000 --workers 0,14 --device cuda \
        --teacher 'ckpt:TEACHER.pt' --batch-size 256          # the GPU recipe's add-teacher, on a GPU host

Builds one phantom shard folder (stored at ``--size`` px, ``--n-aug`` views and ``--n-captions`` captions a
sample, the placeholder tiny teacher), then, per round and per ``--workers`` value, copies it and adds
``--teacher`` to the copy, timed from the call to its return (the teacher loaded once before). Every copy must
come out byte for byte the same: the benchmark says so, or stops. ``--torch-threads 1`` leaves a core of a 2-core
box to a worker while the CPU teacher runs (a GPU host's teacher leaves the cores to the workers anyway).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.tar*"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="phantom studies")
    parser.add_argument("--size", type=int, default=224, help="stored image size (px)")
    parser.add_argument("--n-aug", type=int, default=2)
    parser.add_argument("--n-captions", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=250)
    parser.add_argument("--teacher", default="random:tiny?name=added", help="the teacher spec added")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", default="0,1", help="comma-separated --workers values to time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args()

    import torch

    from cxrdr.reinforce.add_teacher import add_teachers
    from cxrdr.reinforce.build import build
    from cxrdr.reinforce.options import BuildOptions, load_build_teachers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "built"
        build(BuildOptions(source=f"phantom:{args.n}", teachers="random:tiny", out=source, n_aug=args.n_aug,
                           n_captions=args.n_captions, store_size=args.size, shard_size=args.shard_size,
                           device="cpu", progress=False))
        teachers = load_build_teachers(BuildOptions(teachers=args.teacher), torch.device(args.device))
        seconds: dict[int, list[float]] = {w: [] for w in workers}
        reference = None
        for _ in range(args.rounds):
            for w in workers:
                copy = Path(tmp) / f"workers-{w}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(source, copy)
                start = time.perf_counter()
                add_teachers(copy, args.teacher, device=args.device, batch_size=args.batch_size, progress=False,
                             teachers=teachers, workers=w)
                seconds[w].append(time.perf_counter() - start)
                written = shard_bytes(copy)
                reference = reference or written
                if written != reference:
                    sys.exit(f"--workers {w} wrote other bytes than --workers {workers[0]}")
    print(f"add-teacher {args.teacher} on {args.n} samples at {args.size} px (K {args.n_aug}, S {args.n_captions}), "
          f"{args.device}, batch {args.batch_size}, torch threads {torch.get_num_threads()}; the same bytes each way")
    print("| workers | seconds (each round) | median samples/s |")
    print("|---|---|---|")
    for w, times in seconds.items():
        print(f"| {w} | {', '.join(f'{t:.2f}' for t in times)} | {args.n / statistics.median(times):,.0f} |")


if __name__ == "__main__":
    main()
