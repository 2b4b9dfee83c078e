"""The samples an evaluation reads: one split of a shard folder, in shard order, through the contract."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from cxrdr.common.shards import Sample, decode_sample, iter_raw_samples, read_dataset_info
from cxrdr.train.data import split_shards

TEXT_SECTIONS = ("both", "report", "findings", "impression")


def iter_samples(shards_dir, split: str):
    """Decoded samples of one split in shard order (single process, deterministic, strict reader)."""
    urls, _ = split_shards(shards_dir, split, read_dataset_info(shards_dir))
    for raw in iter_raw_samples(urls):
        sample = decode_sample(raw)
        if sample.split == split:
            yield sample


def load_split(shards_dir, split: str, max_samples: int | None = None) -> list[Sample]:
    samples = []
    for s in iter_samples(shards_dir, split):
        samples.append(s)
        if max_samples and len(samples) >= max_samples:
            break
    return samples


@dataclass(frozen=True)
class TrainSplitRows:
    """What an evaluation reads of the train split: the linear probe's rows (an even stride over the split, at
    most ``max_rows``, so a fixed shard folder always gives the same rows) and every image's boxes as (width,
    height, boxes), the train-box prior's input."""
    probe: tuple[Sample, ...]
    boxes: tuple[tuple, ...]


def train_split_rows(shards_dir, split: str, max_rows: int | None) -> TrainSplitRows:
    """``TrainSplitRows`` of ``split``, read in one pass and kept for the process while the folder's dataset.json
    is unchanged: a recipe evaluates a dozen runs against one train split (on this 2-core box a pass over the GPU
    recipe's 16,000 train studies took ~7 s, and an evaluation made two)."""
    info = Path(shards_dir) / "dataset.json"
    stamp = info.stat().st_mtime_ns if info.is_file() else 0
    return _read_train_split(str(Path(shards_dir).resolve()), split, max_rows, stamp)


@functools.lru_cache(maxsize=2)
def _read_train_split(shards_dir: str, split: str, max_rows: int | None, stamp: int) -> TrainSplitRows:
    count = int(read_dataset_info(shards_dir).get("counts", {}).get(split, 0) or 0)
    if not count:
        return TrainSplitRows((), ())
    stride = max(1, math.ceil(count / max_rows)) if max_rows else 1
    probe, boxes = [], []
    for i, sample in enumerate(iter_samples(shards_dir, split)):
        if i % stride == 0 and not (max_rows and len(probe) >= max_rows):
            probe.append(sample)
        if sample.meta.get("boxes"):
            width, height = sample.meta.get("image_size") or sample.image().size
            boxes.append((width, height, sample.meta["boxes"]))
    return TrainSplitRows(tuple(probe), tuple(boxes))


def retrieval_text(sample: Sample, section: str) -> tuple[str, bool]:
    """(retrieval text of ``section``, whether it fell back to the stored report)."""
    findings = (sample.meta.get("findings") or "").strip()
    impression = (sample.meta.get("impression") or "").strip()
    if section == "report":
        return sample.report, False
    chosen = {"findings": findings, "impression": impression,
              "both": " ".join(t for t in (findings, impression) if t)}[section]
    return (chosen, False) if chosen else (sample.report, True)
