"""The shard plan: records ordered train, val, test and cut into shards that never mix splits.

Fixed before any image work, so every rank and every ``--resume`` agree on it (``stats/plan.json``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cxrdr.common.shards import shard_name
from cxrdr.reinforce.records import iter_splits


@dataclass
class ShardPlan:
    index: int
    split: str
    items: list  # [(key, Record)]
    compression: str = "gzip"

    @property
    def name(self) -> str:
        return shard_name(self.index, self.compression)

    def describe(self) -> dict:
        ids = hashlib.sha1("\n".join(r.id for _, r in self.items).encode()).hexdigest()[:16]
        return {"index": self.index, "name": self.name, "split": self.split,
                "records": len(self.items), "ids_sha1": ids}


def cut_shards(keyed_records, shard_size: int, compression: str = "gzip") -> list[ShardPlan]:
    """Order by split (train, val, test), keep source order inside a split, never mix splits."""
    keys = {id(rec): key for key, rec in keyed_records}
    shards: list[ShardPlan] = []
    for split, recs in iter_splits([rec for _, rec in keyed_records]):
        for start in range(0, len(recs), shard_size):
            chunk = recs[start:start + shard_size]
            shards.append(ShardPlan(len(shards), split, [(keys[id(r)], r) for r in chunk], compression))
    return shards
