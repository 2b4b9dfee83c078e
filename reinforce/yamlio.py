"""Reading config files (YAML mappings into dataclasses) with errors that name the file and key."""
from __future__ import annotations

from pathlib import Path


def read_yaml_mapping(path: str | Path, what: str) -> dict:
    """Parse ``path`` as a YAML mapping; ``what`` names its contents in error messages."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of {what}")
    return data


def check_known_fields(cls, data: dict, what: str, where: str = "") -> None:
    """Raise naming the keys of ``data`` that are not fields of dataclass ``cls`` (typos in configs)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}unknown {what}(s) {unknown}; known: {sorted(known)}")
