"""What shard compression costs and saves: bytes on disk per sample against the payload, and the
strict reader's samples/s, for the same samples written as plain tars and as gzip tars.

    python benchmarks/shard_storage.py demo/shards [--rounds 5]

The folder's shards are read once and written again both ways into a temp folder (the writer the
build uses, ``cxrdr.reinforce.writer.TarOut``), so both layouts hold byte-identical members.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from cxrdr.common.shards import iter_tar_samples, read_dataset_info, shard_name
from cxrdr.reinforce.writer import TarOut


def write_copies(shards_dir: Path, out: Path) -> dict[str, list[Path]]:
    """Every shard of ``shards_dir`` written as plain and gzip tars under ``out``."""
    info = read_dataset_info(shards_dir)
    written: dict[str, list[Path]] = {"none": [], "gzip": []}
    for index, shard in enumerate(info["shards"]):
        samples = list(iter_tar_samples(shards_dir / shard["name"]))
        for compression, paths in written.items():
            path = out / shard_name(index, compression)
            with open(path, "wb") as f:
                tar = TarOut(f, compression)
                for key, members in samples:
                    tar.write({"__key__": key, **members})
                tar.close()
            paths.append(path)
    return written


def read_seconds(paths: list[Path], rounds: int) -> float:
    """Best of ``rounds`` full reads of ``paths`` with the strict reader (the file cache is warm)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for path in paths:
            for _ in iter_tar_samples(path):
                pass
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    info = read_dataset_info(args.shards)
    n, payload = info["total_samples"], info["bytes_per_sample"]["total"]
    print(f"{args.shards}: {n} samples, {payload:.0f} bytes/sample of payload "
          f"(members: {', '.join(f'{k} {v:.0f}' for k, v in info['bytes_per_sample'].items() if k != 'total')})")
    with tempfile.TemporaryDirectory() as tmp:
        written = write_copies(args.shards, Path(tmp))
        print(f"{'compression':<12} {'bytes/sample':>13} {'x payload':>10} {'read samples/s':>15}")
        for compression, paths in written.items():
            disk = sum(p.stat().st_size for p in paths) / n
            rate = n / read_seconds(paths, args.rounds)
            print(f"{compression:<12} {disk:>13.0f} {disk / payload:>10.3f} {rate:>15.0f}")


if __name__ == "__main__":
    main()
