"""Teacher registry: turn a spec string into a loaded, frozen ``Teacher``.

Spec grammar (several teachers: comma-separated, ``load_teachers("a,b")``)::

    biomedclip[:SNAPSHOT_DIR]            BiomedCLIP (hf-hub or a local snapshot, see openclip.py)
    openclip:ARCH[:PRETRAINED_OR_PATH]   any open_clip architecture; tag, .pt/.bin/.safetensors, or none (random init)
    ckpt:PATH                            a checkpoint written by `train run` (plug-in from cxrdr.train)
    text:minilm | text:PATH              text-only teacher (packaged MiniLM or a local sentence-transformer dir)
    random:tiny                          a seeded random tiny CLIP, for tests and benchmarks only

Kinds beyond the built-ins are plug-ins: ``register_teacher(kind, loader)``, or an entry point in
the ``cxrdr.teachers`` group (``ckpt`` is one: ``cxrdr.train.ckpt_teacher:load_ckpt_teacher``, so this
registry never imports stage 2).

Any spec may end in ``?key=value&key=value`` options: ``logit_scale=50`` overrides the recorded
logit scale, ``context_length=N`` the text context, ``name=NAME`` the file-safe name.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Callable

from .base import Teacher, TeacherError, file_safe_name, weights_fingerprint
from .openclip import load_biomedclip, load_openclip
from .random_tiny import load_random_teacher
from .text import load_text_teacher

# A loader: loader(arg, spec=..., device=..., model_cache=..., options=...) -> Teacher.
Loader = Callable[..., Teacher]
ENTRY_POINT_GROUP = "cxrdr.teachers"  # plug-ins, e.g. `ckpt` from cxrdr.train (pyproject.toml)

_BUILTIN: dict[str, Loader] = {
    "biomedclip": load_biomedclip,
    "openclip": load_openclip,
    "text": load_text_teacher,
    "random": load_random_teacher,
}
_REGISTERED: dict[str, Loader] = {}  # register_teacher(); wins over built-ins and entry points
VALID_SPECS = ("biomedclip[:DIR]", "openclip:ARCH[:PRETRAINED_OR_PATH]", "text:minilm", "text:PATH", "random:tiny")
_NEEDS_ARG = {"openclip", "text", "random"}  # and every plug-in

__all__ = ["Teacher", "TeacherError", "VALID_SPECS", "known_kinds", "load_teacher", "load_teachers", "parse_spec",
           "register_teacher", "split_specs", "weights_fingerprint"]


def register_teacher(kind: str, loader: Loader) -> None:
    """Make ``KIND:ARG`` specs load with ``loader`` (programmatic plug-in; entry points need no call)."""
    _REGISTERED[kind.strip().lower()] = loader


def _plugin_entry_points() -> dict[str, EntryPoint]:
    return {ep.name.lower(): ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_kinds() -> list[str]:
    """Every teacher kind a spec may start with: built-ins, registered loaders and entry-point plug-ins."""
    return sorted({*_BUILTIN, *_REGISTERED, *_plugin_entry_points()})


def _valid_specs() -> str:
    plugins = [f"{kind}:ARG" for kind in known_kinds() if kind not in _BUILTIN]
    return ", ".join([*VALID_SPECS, *plugins])


def _loader(kind: str) -> Loader:
    if kind in _REGISTERED:
        return _REGISTERED[kind]
    if kind in _BUILTIN:
        return _BUILTIN[kind]
    return _plugin_entry_points()[kind].load()


def parse_spec(spec: str) -> tuple[str, str, dict]:
    """'scheme:arg?k=v' -> (scheme, arg, options); TeacherError naming the valid specs when unknown."""
    text = spec.strip()
    options: dict[str, str] = {}
    if "?" in text:
        text, _, query = text.partition("?")
        for item in filter(None, query.split("&")):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise TeacherError(f"bad option {item!r} in teacher spec {spec!r}: expected key=value")
            options[key.strip()] = value.strip()
    scheme, _, arg = text.partition(":")
    scheme = scheme.strip().lower()
    if scheme not in known_kinds():
        raise TeacherError(f"unknown teacher spec {spec!r}; valid specs: {_valid_specs()}")
    if (scheme in _NEEDS_ARG or scheme not in _BUILTIN) and not arg:
        raise TeacherError(f"teacher spec {spec!r} needs an argument; valid specs: {_valid_specs()}")
    return scheme, arg, options


def split_specs(specs: str | list[str]) -> list[str]:
    """'a,b' or ['a', 'b'] -> ['a', 'b'] (blank entries dropped)."""
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    return [item.strip() for item in items if item and item.strip()]


def load_teacher(spec: str, device: str = "cpu", model_cache: str | None = None) -> Teacher:
    """Load one teacher from its spec (see module docstring), frozen, in eval mode, on ``device``."""
    scheme, arg, options = parse_spec(spec)
    teacher = _loader(scheme)(arg, spec=spec.strip(), device=str(device), model_cache=model_cache, options=options)
    if "logit_scale" in options:
        teacher.notes.setdefault("model_logit_scale", teacher.logit_scale)
        teacher.logit_scale = _float_option(options, "logit_scale", spec)
    if "name" in options:
        teacher.name = file_safe_name(options["name"])
    return teacher


def load_teachers(specs: str | list[str], device: str = "cpu", model_cache: str | None = None) -> list[Teacher]:
    """Load a comma-separated list of teachers; names must be distinct (they key shard files)."""
    teachers = [load_teacher(spec, device=device, model_cache=model_cache) for spec in split_specs(specs)]
    if not teachers:
        raise TeacherError(f"no teacher specs given; valid specs: {_valid_specs()}")
    seen: dict[str, str] = {}
    for teacher in teachers:
        if teacher.name in seen:
            raise TeacherError(f"teachers {seen[teacher.name]!r} and {teacher.spec!r} share the name "
                               f"{teacher.name!r}; add '?name=OTHER' to one spec")
        seen[teacher.name] = teacher.spec
    return teachers


def _float_option(options: dict, key: str, spec: str) -> float:
    try:
        return float(options[key])
    except ValueError:
        raise TeacherError(f"option {key}={options[key]!r} in teacher spec {spec!r} is not a number") from None
