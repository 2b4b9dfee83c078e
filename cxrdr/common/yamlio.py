"""Reading config files (YAML mappings into dataclasses) with errors that name the file and key."""
from __future__ import annotations

from pathlib import Path


def safe_load(text: str):
    """``yaml.safe_load`` through libyaml's parser where PyYAML was built with it (~10x faster: every student built
    reads its model family's file, every status listing each run's config), the same safe constructor."""
    import yaml

    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def yaml_round_trip(obj):
    """``obj`` as written to YAML and read back (tuples as lists, ...), both ways through libyaml where present."""
    import yaml

    return safe_load(yaml.dump(obj, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False))


def read_yaml_mapping(path: str | Path, what: str) -> dict:
    """Parse ``path`` as a YAML mapping; ``what`` names its contents in error messages."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        data = safe_load(path.read_text()) or {}
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


def validate_fields(obj, what: str, ranges: dict[str, str] | None = None) -> None:
    """Check every field of dataclass instance ``obj`` against its annotated type, and the numeric
    ones against ``ranges`` (name -> interval such as "[0, inf)", "(0, 1]"); ValueError naming
    the field otherwise. Converts in place where the meaning is unambiguous: int -> float for
    float fields, a numeric string -> float (YAML 1.1 reads ``1e-3`` as a string), list -> tuple.
    Strict elsewhere: ``'no'`` is not a bool (it would be truthy), ``2.7`` not an int."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        try:
            value = _coerce(value, hints.get(f.name, typing.Any))
        except _Mismatch as exc:
            raise ValueError(f"{what} '{f.name}': expected {exc}, got {value!r} ({type(value).__name__})") from None
        object.__setattr__(obj, f.name, value)
        interval = (ranges or {}).get(f.name)
        if interval and value is not None and not _in_interval(value, interval):
            raise ValueError(f"{what} '{f.name}': must be in {interval}, got {value!r}")


class _Mismatch(Exception):
    """The expectation a value failed (e.g. 'an integer')."""


def _coerce(value, tp):
    import math
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        expectations = []
        for option in options:
            try:
                return _coerce(value, option)
            except _Mismatch as exc:
                expectations.append(str(exc))
        raise _Mismatch(" or ".join(expectations + (["null"] if type(None) in args else [])))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch("an integer")
    if tp is float:
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise _Mismatch("a finite number") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise _Mismatch("a finite number")
        return float(number)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch("a string")
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch("a mapping")
        if len(args) == 2:
            return {_coerce(k, args[0]): _coerce(v, args[1]) for k, v in value.items()}
        return value
    if origin is tuple and args and args[-1] is not Ellipsis:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _Mismatch(f"a list of {len(args)} values")
        return tuple(_coerce(v, a) for v, a in zip(value, args))
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise _Mismatch("a list")
        return [_coerce(v, args[0]) for v in value] if args else value
    return value


def _in_interval(value, interval: str) -> bool:
    """``value`` in an interval written like "[0, inf)" or "(0, 1]"."""
    lo_text, hi_text = (part.strip() for part in interval[1:-1].split(","))
    lo, hi = float(lo_text), float(hi_text)
    above = value >= lo if interval[0] == "[" else value > lo
    below = value <= hi if interval[-1] == "]" else value < hi
    return above and below
