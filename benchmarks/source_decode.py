"""Milliseconds per source JPEG from file to stored image, decoded whole or at a reduced DCT scale.

    python benchmarks/source_decode.py --n 16 --width 2544 --height 3056 --store 224,256,448

``reinforce build`` decodes a JPEG source at the coarsest DCT scale that keeps it at least
``records.JPEG_DRAFT_GAP`` (2) times the stored size (``records.load_image_for_store``), then resizes
it as before (``augment.resize_short_side``, Lanczos). This times both ways on MIMIC-CXR-sized JPEGs
(phantom studies rendered at 768 px, upscaled to ``--width`` x ``--height`` with a little noise so the
files compress like radiographs, saved at quality 95 in a temporary folder) and prints how far the
stored pixels move (max and mean absolute difference in 8-bit levels) beside how far storing them as
JPEG (quality 95, the build's default) moves them anyway. Nothing here reads ``../shared``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cxrdr.common.augment import resize_short_side  # noqa: E402
from cxrdr.reinforce.phantom import render  # noqa: E402
from cxrdr.reinforce.phantom.source import sample_case  # noqa: E402
from cxrdr.reinforce.prepare import decode_stored_image, encode_image  # noqa: E402
from cxrdr.reinforce.records import Record, load_image, load_image_for_store  # noqa: E402


def write_sources(folder: Path, n: int, width: int, height: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        image = render.render_case(sample_case(0, i), 768).resize((width, height), Image.Resampling.BICUBIC)
        noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, 2.0, (height, width))
        path = folder / f"{i:04d}.jpg"
        Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path, format="JPEG", quality=95)
        paths.append(path)
    return paths


def stored(records: list[Record], short_side: int, reduced: bool) -> tuple[float, list[np.ndarray]]:
    """(seconds per image, the stored-size images) decoding whole or at a reduced scale."""
    start = time.perf_counter()
    images = []
    for record in records:
        image = load_image_for_store(record, short_side)[0] if reduced else load_image(record)
        images.append(np.asarray(resize_short_side(image, short_side), dtype=np.int16))
    return (time.perf_counter() - start) / len(records), images


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16, help="source JPEGs")
    parser.add_argument("--width", type=int, default=2544)
    parser.add_argument("--height", type=int, default=3056)
    parser.add_argument("--store", default="224,256,448", help="stored short sides, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="best of this many timings per way")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cxrdr-decode-") as tmp:
        paths = write_sources(Path(tmp), args.n, args.width, args.height)
        records = [Record(id=p.stem, subject_id=p.stem, study_id=p.stem, split="train", report="", image=p)
                   for p in paths]
        print(f"{args.n} JPEG sources, {args.width} x {args.height}, quality 95")
        print("| stored short side | whole decode ms | reduced decode ms | speed-up | reduced vs whole: max, mean "
              "| stored JPEG vs its pixels: max, mean |")
        print("|---|---|---|---|---|---|")
        for short_side in (int(s) for s in args.store.split(",")):
            whole_s, whole = min((stored(records, short_side, False) for _ in range(args.rounds)), key=lambda r: r[0])
            reduced_s, reduced = min((stored(records, short_side, True) for _ in range(args.rounds)),
                                     key=lambda r: r[0])
            moved = [np.abs(a - b) for a, b in zip(reduced, whole)]
            quantised = [np.abs(np.asarray(decode_stored_image(encode_image(Image.fromarray(a.astype(np.uint8)),
                                                                            "jpg", 95)), dtype=np.int16) - a)
                         for a in whole]
            print(f"| {short_side} | {1000 * whole_s:.1f} | {1000 * reduced_s:.1f} | {whole_s / reduced_s:.2f}x "
                  f"| {max(int(m.max()) for m in moved)}, {np.mean([m.mean() for m in moved]):.3f} "
                  f"| {max(int(q.max()) for q in quantised)}, {np.mean([q.mean() for q in quantised]):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
