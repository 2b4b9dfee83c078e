"""Milliseconds per phantom image: the render on its row and column grids against full N x N grids.

    python benchmarks/phantom_render.py --n 96 --size 256 --rounds 3

The render draws on a (1, N) row X and an (N, 1) column Y that numpy broadcasts
(``cxrdr.reinforce.phantom.render._grid``); the full grids are the same pixel centres spelled out
over every pixel, as the render once drew. Both ways render the same ``--n`` cases (sampled
untimed) in alternating rounds, with glibc's freed-memory thresholds raised as ``reinforce build``
runs; the best round of each is printed, and the images are checked to be byte-identical.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cxrdr.common.allocator import keep_freed_memory  # noqa: E402
from cxrdr.reinforce.phantom import render  # noqa: E402
from cxrdr.reinforce.phantom.source import sample_case  # noqa: E402


def _full_grid(row_and_column):
    def grid(size: int):
        X, Y = row_and_column(size)
        return tuple(np.meshgrid(X.ravel(), Y.ravel()))
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=96, help="phantom cases (seed 0)")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    keep_freed_memory()
    cases = [sample_case(0, i) for i in range(args.n)]
    ways = {"row and column grids": render._grid, "full grids": _full_grid(render._grid)}
    best, images = dict.fromkeys(ways, float("inf")), {}
    for _ in range(args.rounds):
        for name, grid in ways.items():
            render._grid = grid
            try:
                for case in cases[:4]:  # warm: first calls, caches
                    render.render_case(case, args.size)
                start = time.perf_counter()
                images[name] = [render.render_case(case, args.size).tobytes() for case in cases]
                best[name] = min(best[name], time.perf_counter() - start)
            finally:
                render._grid = ways["row and column grids"]
    same = images["row and column grids"] == images["full grids"]
    for name, seconds in best.items():
        print(f"{name}: {1000 * seconds / args.n:.2f} ms per {args.size}-px image (best of {args.rounds} rounds)")
    print(f"speed-up {best['full grids'] / best['row and column grids']:.2f}x; images byte-identical: {same}")
    if not same:
        raise SystemExit("the two ways rendered different images")


if __name__ == "__main__":
    main()
