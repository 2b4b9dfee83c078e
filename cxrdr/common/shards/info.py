"""``dataset.json``: what a build made and how; every reader loads it first."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cxrdr.common.errors import UserError
from cxrdr.common.shards.members import DATASET_JSON, READABLE_SCHEMA_VERSIONS, STATS_DIR


class MissingDatasetError(UserError, FileNotFoundError):
    """dataset.json is missing (both a UserError for the CLI and a FileNotFoundError for callers)."""


def read_dataset_info(shards_dir) -> dict:
    """Load ``dataset.json`` of a shard folder; clear error when missing, invalid or of an
    unreadable schema version."""
    path = Path(shards_dir) / DATASET_JSON
    if not path.is_file():
        hint = (" (the build has not been merged yet: run `reinforce merge " f"{shards_dir}`)"
                if (Path(shards_dir) / STATS_DIR / "plan.json").is_file() else
                " (run `reinforce build --out " f"{shards_dir}` first)")
        raise MissingDatasetError(f"no {DATASET_JSON} in shard folder {shards_dir}{hint}")
    try:
        info = json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from exc
    if info.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise UserError(f"{path} has schema_version {info.get('schema_version')!r}; "
                        f"this code reads versions {', '.join(map(str, READABLE_SCHEMA_VERSIONS))}")
    return info


# dataset.json keys that describe how long a build took, not what it holds
VOLATILE_KEYS = ("build",)


def dataset_identity(info: dict) -> str:
    """The content identity of a shard folder: a hash of its dataset.json without build timings.
    It changes when the shards, their sample counts, teachers (fingerprints), augmentation or
    caption settings change, and not when the folder is moved or named another way."""
    stable = {k: v for k, v in info.items() if k not in VOLATILE_KEYS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
