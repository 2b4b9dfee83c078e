"""Per-member content checksums of shard samples (bit rot, edits): written by the build and by
add-teacher into ``stats/shard-NNNNNN.json["checksums"]``, checked by ``reinforce verify``.

Generic over a sample's members (whatever extensions it holds), so a change of the member layout
needs no change here. CRC-32 (zlib): it detects every 1- and 2-bit error and any burst up to 32
bits in a member, and costs ~1 ms per MB; it guards against damage, not against tampering.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

from cxrdr.common.shards import shard_index, shard_stats_path

ALGORITHM = "crc32"


def recorded_checksums(shard_path: str | Path) -> dict | None:
    """The "checksums" the build recorded for the shard at ``shard_path`` (in its folder's
    ``stats/``); None when it recorded none (a build older than checksums, stats gone)."""
    shard_path = Path(shard_path)
    stats = shard_stats_path(shard_path.parent, shard_index(shard_path.name))
    if not stats.is_file():
        return None
    try:
        return json.loads(stats.read_text()).get("checksums")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{stats}: unreadable shard stats ({exc})") from None


def member_checksums(sample: dict) -> dict[str, str]:
    """{extension: crc32 hex} of a sample's members (keys starting with '__' are not members)."""
    out = {}
    for ext, data in sample.items():
        if ext.startswith("__"):
            continue
        if isinstance(data, str):
            data = data.encode("utf-8")
        out[ext] = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    return out


def checksum_record(by_key: dict[str, dict[str, str]]) -> dict:
    """The value stored under "checksums" in a shard's stats."""
    return {"algorithm": ALGORITHM, "samples": by_key}


def checksum_problems(where: str, key: str, sample: dict, recorded: dict | None) -> list[str]:
    """Lines naming every member of ``sample`` whose bytes differ from the recorded checksums.
    ``recorded``: the shard's stats["checksums"] (None: a build older than checksums, not checked)."""
    if not recorded or recorded.get("algorithm") != ALGORITHM:
        return []
    expected = recorded.get("samples", {}).get(key)
    if expected is None:
        return [f"{where}: no checksum recorded for this sample (not written by the build)"]
    actual = member_checksums(sample)
    problems = [f"{where}: member {key}.{ext} content differs from the build (crc32 {actual[ext]}, "
                f"recorded {expected[ext]})" for ext in actual if ext in expected and actual[ext] != expected[ext]]
    problems += [f"{where}: member {key}.{ext} has no recorded checksum" for ext in actual if ext not in expected]
    problems += [f"{where}: member {key}.{ext} is gone" for ext in expected if ext not in actual]
    return problems
