"""Sample keys: the ``<key>`` of every member name, unique within a shard folder."""
from __future__ import annotations

import hashlib
import re

from cxrdr.common.errors import UserError

_KEY_BAD_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


def safe_key(record_id: str) -> str:
    """A WebDataset-safe sample key: no dots (they separate key and extension) or slashes."""
    key = _KEY_BAD_CHARS.sub("_", record_id).strip("_")
    return key or "sample"


def assign_keys(records) -> list[tuple[str, object]]:
    """[(key, record)] for records with an ``.id``: safe_key(id), plus a short id hash when two ids
    sanitise alike.

    Unique by construction: the first record of each sanitised key keeps it, and a later one's
    hashed key must avoid every sanitised key of the whole list (ids 'x', 'x-914ba315', 'x.'
    would otherwise give 'x-914ba315' twice) and every key given so far; if it does not, the hash
    grows (then a counter is added), all deterministic in the list of ids.
    """
    natural = [safe_key(rec.id) for rec in records]
    taken, out = set(), []
    reserved = set(natural)
    for rec, key in zip(records, natural):
        if key in taken:
            key = _disambiguated_key(key, rec.id, taken | reserved)
        taken.add(key)
        out.append((key, rec))
    check_unique_keys(out)
    return out


def _disambiguated_key(key: str, record_id: str, avoid: set) -> str:
    digest = hashlib.sha1(record_id.encode("utf-8", "backslashreplace")).hexdigest()
    for length in (8, 12, 16, 40):
        candidate = f"{key}-{digest[:length]}"
        if candidate not in avoid:
            return candidate
    n = 2
    while f"{key}-{digest}-{n}" in avoid:
        n += 1
    return f"{key}-{digest}-{n}"


def check_unique_keys(keyed_records) -> None:
    """Refuse before any image work if two records share a key (merge would fail after all of it)."""
    first: dict[str, str] = {}
    for key, rec in keyed_records:
        if key in first:
            raise UserError(f"records {first[key]!r} and {rec.id!r} both get the sample key {key!r}")
        first[key] = rec.id
