"""The samples an evaluation reads: one split of a shard folder, in shard order, through the contract."""
from __future__ import annotations

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


def retrieval_text(sample: Sample, section: str) -> tuple[str, bool]:
    """(retrieval text of ``section``, whether it fell back to the stored report)."""
    findings = (sample.meta.get("findings") or "").strip()
    impression = (sample.meta.get("impression") or "").strip()
    if section == "report":
        return sample.report, False
    chosen = {"findings": findings, "impression": impression,
              "both": " ".join(t for t in (findings, impression) if t)}[section]
    return (chosen, False) if chosen else (sample.report, True)
