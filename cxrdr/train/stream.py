"""The training stream of `train run`: endless batches whose position a checkpoint can hold, so that
a resumed run reads exactly what the uninterrupted run would have read.

Every random choice is a pure function of the seed and a position, never of a process's history:

- *slots*: DataLoader worker ``w`` of rank ``r`` is slot ``g = r * W + w`` of ``T = world * W``
  (``W = max(1, workers)``); each slot reads its own endless sequence of *rounds* (epochs);
- round ``e`` of slot ``g``: the train shards in the order of a permutation seeded by (seed, e);
  the slot reads every T-th of them from ``g`` (with fewer shards than slots: shard ``g mod n``,
  as copy ``g // n``), through a shuffle buffer seeded by (seed, e, g);
- each sample's stored view and caption (or plain mode's fresh augmentation) are drawn from an
  RNG seeded by (seed, e, copy, key) (:func:`cxrdr.train.data.sample_rng`);
- a slot's batches are consecutive runs of ``batch_size`` usable samples of that endless sequence.

Each batch carries ``batch["stream"] = (slot worker, round, offset)``: the offset, within the
round's shuffled order, just after its last sample. The trainer keeps the last position it
consumed from each worker and the number of batches consumed (:class:`StreamState`); since the
DataLoader takes batches from its workers in turn, that is the whole position. On resume each
worker replays its round from the start through the shuffle buffer (reading tar bytes, decoding
nothing) and drops ``offset`` samples; the worker the uninterrupted run would have asked next is
given DataLoader worker id 0 (``phase``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from cxrdr.common.augment import stable_seed
from cxrdr.common.shards import decode_sample
from cxrdr.train.data import SampleView, TrainingParts, already_collated, shuffled_shards
from cxrdr.train.integrity import CheckedTarSamples, ChecksumCheck, CorruptPolicy, Guarded

SHUFFLE_INITIAL = 64  # samples the buffer holds before its first output (as the one-pass loader)


def round_shards(urls: list[str], seed: int, epoch: int, slot: int, slots: int) -> tuple[list[str], int]:
    """(the shards slot ``slot`` of ``slots`` reads in round ``epoch``, its copy index)."""
    order = shuffled_shards(urls, seed, epoch)
    if len(order) >= slots:
        return order[slot::slots], 0
    return [order[slot % len(order)]], slot // len(order)


@dataclass
class StreamState:
    """The position of one rank's stream: batches consumed and, per worker, (round, offset) after
    the last batch consumed from it. Plain lists and ints, so a checkpoint reads it back safely."""

    workers: int
    batches: int = 0
    positions: list = field(default_factory=list)

    def __post_init__(self):
        self.workers = max(1, int(self.workers))
        if not self.positions:
            self.positions = [[0, 0] for _ in range(self.workers)]

    @property
    def phase(self) -> int:
        """The worker whose batch comes next."""
        return self.batches % self.workers

    @property
    def epoch(self) -> int:
        """The round of the least advanced worker (bookkeeping only)."""
        return min(p[0] for p in self.positions)

    def consumed(self, position) -> None:
        worker, epoch, offset = (int(v) for v in position)
        self.positions[worker] = [epoch, offset]
        self.batches += 1

    def to_dict(self) -> dict:
        return {"workers": self.workers, "batches": self.batches, "positions": [list(p) for p in self.positions]}


@dataclass
class PrepareSample:
    """Raw sample -> training example: checksums (when asked), decode, split filter, the view."""

    view: SampleView
    checksums: ChecksumCheck | None = None

    def __call__(self, raw: dict, epoch: int, draw: int):
        if self.checksums is not None:
            self.checksums(raw)
        sample = decode_sample(raw)
        if not self.view.keep(sample):
            return None
        return self.view(sample, epoch, draw)


@dataclass
class ShardMemory:
    """The raw samples of the shards a loader process has read whole, kept for its later rounds while all of them
    fit in ``max_bytes``: a small split (the demo's train shards: ~6 MB) is read every round, and reading a shard
    again is Python's tar parsing and the gzip stream each time (~8 of a demo batch's ~36 ms). The samples come
    back as they were read (copies of the dicts: nothing downstream changes a kept one); a shard read with damage
    the policy skipped is read from disk again each round, as before."""

    max_bytes: int
    _kept: dict = field(default_factory=dict, repr=False)
    _bytes: int = 0

    def read(self, url: str, reader: CheckedTarSamples):
        kept = self._kept.get(url)
        if kept is not None:
            yield from (dict(sample) for sample in kept)
            return
        samples: list | None = [] if self._bytes < self.max_bytes else None
        size, shard = 0, reader.read(url)
        while True:
            try:
                sample = next(shard)
            except StopIteration as end:
                whole = bool(end.value)
                break
            if samples is not None:
                size += sum(len(v) for v in sample.values() if isinstance(v, (bytes, bytearray)))
                if self._bytes + size <= self.max_bytes:
                    samples.append(sample)
                else:
                    samples = None
            yield dict(sample)
        if whole and samples is not None:
            self._kept[url], self._bytes = samples, self._bytes + size


class TrainStream(IterableDataset):
    """One rank's endless stream of collated batches (see the module docstring)."""

    def __init__(self, parts: TrainingParts, batch_size: int, state: StreamState, *, seed: int,
                 shuffle_buffer: int, rank: int, world: int, policy: CorruptPolicy, verify_checksums: bool,
                 shard_memory_mb: int = 0):
        self.urls, self.collate, self.batch_size = parts.urls, parts.collate, batch_size
        self.workers, self.phase = state.workers, state.phase
        self.positions = [list(p) for p in state.positions]
        self.seed, self.shuffle_buffer, self.rank, self.world = seed, shuffle_buffer, rank, world
        self.policy = policy
        self.prepare: Callable = Guarded(PrepareSample(parts.view, ChecksumCheck() if verify_checksums else None),
                                         policy)
        self.memory = ShardMemory(shard_memory_mb << 20)  # each loader process fills its own

    def _samples(self, slot: int, epoch: int, skip: int):
        """(round, copy, offset, raw sample) from round ``epoch``, offset ``skip`` on, forever."""
        slots = self.world * self.workers
        while True:
            urls, copy = round_shards(self.urls, self.seed, epoch, slot, slots)
            reader = CheckedTarSamples(self.policy)
            raw = (sample for url in urls for sample in self.memory.read(url, reader))
            if self.shuffle_buffer > 1:
                rng = random.Random(stable_seed("samples", self.seed, epoch, slot))
                raw = wds.shuffle(self.shuffle_buffer, min(self.shuffle_buffer, SHUFFLE_INITIAL), rng=rng)(raw)
            offset = -1
            for offset, sample in enumerate(raw):
                if offset >= skip:
                    yield epoch, copy, offset, sample
            if offset < 0:
                raise ValueError(f"no training samples in round {epoch} of stream slot {slot} "
                                 f"({', '.join(urls)})")
            epoch, skip = epoch + 1, 0

    def __iter__(self):
        info = get_worker_info()
        worker = ((info.id if info is not None else 0) + self.phase) % self.workers
        epoch, skip = self.positions[worker]
        batch: list = []
        for epoch, copy, offset, raw in self._samples(self.rank * self.workers + worker, epoch, skip):
            example = self.prepare(raw, epoch, copy)
            if example is None:  # another split, or damaged and skipped
                continue
            batch.append(example)
            if len(batch) == self.batch_size:
                out = self.collate(batch)
                out["stream"] = (worker, epoch, offset + 1)
                yield out
                batch = []


def make_stream_loader(parts: TrainingParts, batch_size: int, state: StreamState, *, workers: int, seed: int,
                       shuffle_buffer: int, rank: int, world: int, policy: CorruptPolicy,
                       verify_checksums: bool, shard_memory_mb: int = 0) -> DataLoader:
    """The DataLoader (``workers`` processes; 0: in this one) of one rank's :class:`TrainStream`,
    from ``state`` on. 0 and 1 workers give the same stream (one slot per rank). ``shard_memory_mb``: each
    loader process keeps the shards it read whole up to this size (:class:`ShardMemory`)."""
    if max(1, workers) != state.workers:
        raise ValueError(f"stream position of {state.workers} worker(s), loader of {workers}")
    dataset = TrainStream(parts, batch_size, state, seed=seed, shuffle_buffer=shuffle_buffer, rank=rank,
                          world=world, policy=policy, verify_checksums=verify_checksums,
                          shard_memory_mb=shard_memory_mb)
    # A generator of its own: creating the iterator would otherwise draw from the global torch RNG,
    # which a resumed run restores from the checkpoint and must leave as the uninterrupted run does.
    generator = torch.Generator().manual_seed(stable_seed("loader", seed, rank) % (2**63))
    return DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=already_collated,
                      persistent_workers=False,
                      pin_memory=torch.cuda.is_available(), prefetch_factor=2 if workers else None,
                      generator=generator)
