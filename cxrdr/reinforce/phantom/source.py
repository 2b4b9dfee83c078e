"""The phantom as a Source (records rendered lazily by workers) and as files on disk."""
from __future__ import annotations

import collections
import functools
import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Iterator

import typer
from PIL import Image
from tqdm import tqdm

from cxrdr.common.atomic import replacing
from cxrdr.reinforce.phantom.cases import DEVICE, NORMAL_P, Case, sample_case
from cxrdr.reinforce.phantom.render import finding_boxes, render_case
from cxrdr.reinforce.phantom.report import make_report, make_triples
from cxrdr.reinforce.records import Record, SkipLog

PHANTOM_VERSION = 1  # bump when the pictures or the text change for the same seed
RECORD_FIELDS = ("id", "subject_id", "study_id", "split", "view", "report", "findings", "impression",
                 "labels", "triples", "boxes", "image", "extra")


def split_for_subject(subject_id: str) -> str:
    """Patient-disjoint 80/10/10 split, the same rule as the shared data's README."""
    bucket = int(hashlib.sha1(f"split:{subject_id}".encode()).hexdigest(), 16) % 100
    return "train" if bucket < 80 else "val" if bucket < 90 else "test"


def render_phantom(seed: int, index: int, size: int = 256) -> Image.Image:
    """The image of phantom study ``index`` (module level, so ``functools.partial`` of it pickles)."""
    return render_case(sample_case(seed, index), size)


def phantom_record(seed: int, index: int, size: int = 256, split: str | None = None,
                   id_prefix: str = "") -> Record:
    """Record of study ``index`` without rendering; ``image`` renders it when called.

    ``split`` puts the study in that split instead of its subject's (an evaluation phantom is all
    ``test``); ``id_prefix`` tells the ids of another seed apart (its split still follows the
    unprefixed subject, i.e. the split that seed's own build gives it)."""
    case = sample_case(seed, index)
    findings, impression, labels = make_report(case)
    return Record(
        id=id_prefix + case.id, subject_id=id_prefix + case.subject_id, study_id=id_prefix + case.study_id,
        split=split or split_for_subject(case.subject_id), view=case.view,
        report=f"{findings} {impression}".strip(), findings=findings, impression=impression,
        image=functools.partial(render_phantom, seed, index, size),
        labels=labels, triples=make_triples(case), boxes=finding_boxes(case, size),
        extra={"source": "phantom", "phantom": _case_extra(case, size)})


def _case_extra(case: Case, size: int) -> dict:
    return {"version": PHANTOM_VERSION, "seed": case.seed, "index": case.index, "size": size,
            "study_number": case.study_number, "ctr": round(case.geometry.ctr, 3),
            "findings": [f.to_json() for f in case.findings],
            "devices": [f.device for f in case.findings if f.kind == DEVICE]}


SPLITS = ("train", "val", "test")


class PhantomSource:
    """``phantom[:N]``: N generated studies, deterministic in (seed, index), rendered on demand.

    ``seed`` may be a list: N studies of each seed, one after the other; the studies of every seed but
    the first get ids prefixed ``s<seed>-`` (the generator's ids do not name the seed) and keep the split
    their own seed's build gives them, so ``seed: [0, 1]`` holds exactly the train images of a
    ``phantom:N`` build of seed 0 and of seed 1 (the efficiency recipe's "plain on the students' and the
    teacher's images"). ``split`` puts every study in that split: an evaluation phantom drawn with its
    own source seed is all ``test``, a set no choice of a recipe reads.
    """

    requires_images = True

    def __init__(self, n: int, seed: int | list = 0, size: int = 256, split: str | None = None):
        if n < 0:
            raise ValueError(f"phantom: n must be >= 0, got {n}")
        if size < 16:
            raise ValueError(f"phantom: size must be >= 16 px, got {size}")
        if split is not None and split not in SPLITS:
            raise ValueError(f"phantom: split must be one of {SPLITS}, got {split!r}")
        seeds = [int(s) for s in seed] if isinstance(seed, (list, tuple)) else [int(seed)]
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"phantom: seeds must be distinct and at least one, got {seed!r}")
        self.n, self.seeds, self.size, self.split = int(n), seeds, int(size), split
        self.seed = seeds[0]
        self.name = f"phantom:{self.n}"
        self.skipped = SkipLog()  # generated records are never bad

    def __len__(self) -> int:
        return self.n * len(self.seeds)

    def __iter__(self) -> Iterator[Record]:
        for position, seed in enumerate(self.seeds):
            prefix = f"s{seed}-" if position else ""
            for index in range(self.n):
                yield phantom_record(seed, index, self.size, self.split, prefix)

    def describe(self) -> dict:
        seed = self.seeds if len(self.seeds) > 1 else self.seed
        split = {"split": self.split} if self.split else {}  # absent: by subject, 80/10/10
        return {"kind": "phantom", "name": self.name, "n": self.n, "seed": seed, "size": self.size, **split,
                "version": PHANTOM_VERSION, "normal_fraction_target": NORMAL_P,
                "boxes": "one per finding in rendered-image pixels, with its side; bilateral findings get one box per lung"}


def record_row(record: Record, image_path: str) -> dict:
    """A records.jsonl row: Record field names, image as a path relative to the jsonl."""
    row = {name: getattr(record, name) for name in RECORD_FIELDS}
    row["image"] = image_path
    row["triples"] = [list(t) for t in record.triples]
    return row


def write_phantom_dataset(n: int, out_dir: str | Path, seed: int = 0, size: int = 256,
                          progress: bool = True) -> Path:
    """Write ``out_dir/images/<id>.png`` and ``out_dir/records.jsonl``; returns the jsonl path.

    Byte-identical for the same (n, seed, size): PNGs are encoded with fixed settings and
    jsonl rows are dumped with sorted keys. The jsonl is renamed into place once every image is written: a command
    killed midway leaves none (not the first rows of one, which a build would read as the whole set).
    """
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    source = PhantomSource(n, seed=seed, size=size)
    jsonl = out / "records.jsonl"
    jsonl.unlink(missing_ok=True)  # an earlier set's rows must not outlive the images written over theirs
    with replacing(jsonl) as partial, open(partial, "w", encoding="utf-8") as fh:
        for record, png in tqdm(_rendered(source), total=n, desc="phantom", unit="img", disable=not progress):
            rel = f"images/{record.id}.png"
            (out / rel).write_bytes(png)
            fh.write(json.dumps(record_row(record, rel), sort_keys=True, ensure_ascii=False) + "\n")
    return jsonl


def _png(record: Record) -> bytes:
    buffer = io.BytesIO()
    record.image().save(buffer, format="PNG", optimize=False, compress_level=6)
    return buffer.getvalue()


def _rendered(records, threads: int = min(4, os.cpu_count() or 1)) -> Iterator[tuple[Record, bytes]]:
    """(record, its PNG) in order, rendered and encoded a few at a time on ``threads`` threads: numpy and zlib
    release the GIL for most of it (600 studies at 256 px, 2-core box: 9.1 ms a study on one thread, 6.3 on two).
    Each study's image depends on (seed, index) alone, so the bytes are those of a serial run."""
    window: collections.deque = collections.deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="phantom") as pool:
        for record in records:
            window.append((record, pool.submit(_png, record)))
            if len(window) > 2 * threads:  # a few ahead at most: memory stays flat for any n
                done, future = window.popleft()
                yield done, future.result()
        while window:
            done, future = window.popleft()
            yield done, future.result()


def cli_phantom(
    n: Annotated[int, typer.Option("--n", min=1, help="Number of studies (images) to generate.")] = 200,
    out: Annotated[Path, typer.Option("--out", help="Output folder: gets images/<id>.png and records.jsonl.",
                                      file_okay=False)] = Path("phantom"),
    seed: Annotated[int, typer.Option("--seed", help="Generator seed; the same seed gives byte-identical files.")] = 0,
    size: Annotated[int, typer.Option("--size", min=16, help="Image side in pixels (square, grayscale).")] = 256,
) -> None:
    """Generate phantom chest X-rays with reports, triples, labels and boxes (the embedded default data).

    Each study shows 0-3 findings of known kind, side, zone and severity; about 30% are normal.
    Kinds: cardiomegaly, pleural effusion, pneumothorax, nodule, mass, consolidation, lung opacity,
    atelectasis, edema, and support devices (tube, line, ECG leads).
    Subjects have 1-4 studies; the split is 80/10/10 by subject (patient-disjoint).
    Read the files back with --source jsonl:OUT/records.jsonl, or skip the files with --source phantom:N.
    """
    jsonl = write_phantom_dataset(n, out, seed=seed, size=size)
    typer.echo(f"wrote {n} phantom studies ({size}px, seed {seed}) to {jsonl.parent} (records: {jsonl})")
