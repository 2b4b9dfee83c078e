"""Damaged shard input during training: name the shard and key, then stop or skip and count.

Three layers, independent of how a sample's members are laid out:
- ``CheckedTarSamples`` reads each tar strictly (``cxrdr.common.shards.iter_tar_samples``): a
  truncated member, a duplicated member or a tar cut at a member boundary (no end-of-archive
  marker) is an error naming the shard and the last good key; webdataset's reader would raise a
  long traceback or stop silently, losing the samples after the cut.
- ``Guarded`` wraps the per-sample functions (split filter, view): any decode error of one
  sample (bad JSON, image, .npy) is reported with its shard and key.
- ``check_embedding`` checks decoded teacher embeddings (finite, rows of norm ~1): flipped bytes
  in a float16 .npy give rows of norm 6e4 that would otherwise be distilled from silently.
- ``ChecksumCheck`` (``train run --verify-checksums``) compares every member's bytes with the
  CRC-32 the build recorded (``cxrdr.common.checksums``, as ``reinforce verify`` does): a flipped
  byte in a JPEG that still decodes, or in an embedding whose norm stays near 1, is caught too.

``CorruptPolicy``: ``stop`` (default) raises ``CorruptDataError`` (one line at the CLI); ``skip``
logs the sample to ``RUN/skipped.jsonl`` (one JSON line per event; workers append) and goes on.
"""
from __future__ import annotations

import json
import os
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from cxrdr.common.checksums import checksum_problems, recorded_checksums
from cxrdr.common.errors import UserError
from cxrdr.common.shards import Sample, iter_tar_samples

ON_CORRUPT = ("stop", "skip")
# Stored rows are L2-normalised before storage; float16 keeps norms within ~1e-3, int8 within
# ~1e-2. 0.05 accepts every codec and still rejects damaged rows.
NORM_TOLERANCE = 0.05
# Errors that mean "this sample's bytes are bad", not a bug in the reader.
SAMPLE_ERRORS = (ValueError, OSError, KeyError, IndexError, TypeError, EOFError, SyntaxError,
                 tarfile.TarError)
SKIP_LOG = "skipped.jsonl"
CHECKSUM_CACHE = 8  # shards whose recorded checksums a stream keeps (its shuffle buffer spans a few)


class CorruptDataError(UserError):
    """A damaged shard or sample met with ``on_corrupt='stop'``."""


class ChecksumError(ValueError):
    """A member's bytes differ from the CRC-32 its build recorded."""


def check_embedding(values: np.ndarray, what: str, tolerance: float = NORM_TOLERANCE) -> np.ndarray:
    """``values`` (decoded, float) unchanged when finite with L2 row norms within ``tolerance`` of 1;
    else ValueError naming ``what`` (e.g. 'random-tiny.img')."""
    values = np.asarray(values)
    if values.size == 0:
        raise ValueError(f"{what} embedding is empty")
    if not np.isfinite(values).all():
        raise ValueError(f"{what} embedding has NaN or inf values")
    norms = np.linalg.norm(values.reshape(-1, values.shape[-1]).astype(np.float64), axis=1)
    worst = float(np.abs(norms - 1.0).max())
    if worst > tolerance:
        raise ValueError(f"{what} embedding rows are not unit vectors (norms {norms.min():.4g}.."
                         f"{norms.max():.4g}; damaged bytes?)")
    return values


@dataclass
class CorruptPolicy:
    """What to do with a damaged shard or sample: 'stop' or 'skip' (logged to ``log_path``)."""

    mode: str = "stop"
    log_path: str | None = None
    _seen: set = field(default_factory=set, repr=False)

    def __post_init__(self):
        if self.mode not in ON_CORRUPT:
            raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {self.mode!r}")

    def handle(self, url, key, exc: BaseException) -> None:
        shard = Path(str(url)).name if url else "?"
        first = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{type(exc).__name__}: {first}"
        if self.mode == "stop":
            raise CorruptDataError(f"corrupt training input: {shard}: key {key}: {reason} "
                                   f"(--on-corrupt skip skips and counts such samples)") from exc
        if (shard, key) not in self._seen:  # resampled shards come back: warn once per process
            self._seen.add((shard, key))
            print(f"warning: skipped corrupt input {shard}: key {key}: {reason}", file=sys.stderr)
        if self.log_path:
            line = json.dumps({"shard": shard, "key": key, "reason": reason, "pid": os.getpid()})
            with open(self.log_path, "a") as fh:  # O_APPEND: workers' short lines do not interleave
                fh.write(line + "\n")


def count_skipped(log_path: str | os.PathLike) -> dict:
    """Distinct (shard, key) entries of a skip log: {"count", "samples": [{"shard", "key", "reason"}]}."""
    path = Path(log_path)
    if not path.is_file():
        return {"count": 0, "samples": []}
    seen: dict = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        seen.setdefault((entry.get("shard"), entry.get("key")), entry)
    samples = [{k: e.get(k) for k in ("shard", "key", "reason")} for e in seen.values()]
    return {"count": len(samples), "samples": samples[:50]}


@dataclass
class CheckedTarSamples:
    """WebDataset stage: shard dicts {"url": path} -> raw samples {"__key__", "__url__", ext: bytes}."""

    policy: CorruptPolicy

    def __call__(self, shards):
        for shard in shards:
            yield from self.read(shard["url"])

    def read(self, url: str):
        """One shard's raw samples; the generator returns True when it read the shard to its end (False: the
        policy skipped its damage)."""
        last = None
        try:
            for key, parts in iter_tar_samples(Path(url)):
                last = key
                yield {"__key__": key, "__url__": url, **parts}
        except (tarfile.TarError, EOFError, OSError) as exc:
            where = f"(unreadable tar after {last})" if last else "(unreadable tar)"
            self.policy.handle(url, where, exc)
            return False
        return True


@dataclass
class Guarded:
    """``fn(sample)`` (a raw or a decoded sample), or the policy's verdict on a sample it cannot
    decode (None: drop it)."""

    fn: Callable
    policy: CorruptPolicy

    def __call__(self, sample: dict, *args):
        try:
            return self.fn(sample, *args)
        except CorruptDataError:
            raise
        except SAMPLE_ERRORS as exc:
            if isinstance(sample, Sample):
                self.policy.handle(sample.url, sample.key, exc)
            else:  # a raw sample the decoder refused
                self.policy.handle(sample.get("__url__"), sample.get("__key__"), exc)
            return None


@dataclass
class ChecksumCheck:
    """Raw sample -> the same sample, once each member's CRC-32 equals the one its build recorded
    (``stats/shard-NNNNNN.json``); ChecksumError naming the member otherwise. Shards whose build
    recorded no checksums (older builds) pass unchecked."""

    _records: dict = field(default_factory=dict, repr=False)

    def __call__(self, raw: dict) -> dict:
        url, key = raw["__url__"], raw["__key__"]
        if url not in self._records:
            if len(self._records) >= CHECKSUM_CACHE:
                self._records.pop(next(iter(self._records)))
            self._records[url] = recorded_checksums(url)
        problems = checksum_problems("stored bytes", key, raw, self._records[url])
        if problems:
            raise ChecksumError(problems[0])
        return raw
