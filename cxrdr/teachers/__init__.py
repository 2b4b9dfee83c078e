"""Teacher registry: turn a spec string into a loaded, frozen ``Teacher``.

Spec grammar (several teachers: comma-separated, ``load_teachers("a,b")``)::

    biomedclip[:SNAPSHOT_DIR]            BiomedCLIP (hf-hub or a local snapshot, see openclip.py)
    openclip:ARCH[:PRETRAINED_OR_PATH]   any open_clip architecture; tag, .pt/.bin/.safetensors, or none (random init)
    ckpt:PATH                            a checkpoint written by `train run`
    text:minilm | text:PATH              text-only teacher (packaged MiniLM or a local sentence-transformer dir)
    random:tiny                          a seeded random tiny CLIP, for tests and benchmarks only

Any spec may end in ``?key=value&key=value`` options: ``logit_scale=50`` overrides the
recorded logit scale, ``context_length=N`` the text context, ``name=NAME`` the file-safe name.
"""
from __future__ import annotations

import importlib

from .base import Teacher, TeacherError, file_safe_name, weights_fingerprint

# scheme -> (module, loader function); imported lazily so `--help` stays fast.
_REGISTRY: dict[str, tuple[str, str]] = {
    "biomedclip": ("cxrdr.teachers.openclip", "load_biomedclip"),
    "openclip": ("cxrdr.teachers.openclip", "load_openclip"),
    "ckpt": ("cxrdr.teachers.ckpt", "load_ckpt_teacher"),
    "text": ("cxrdr.teachers.text", "load_text_teacher"),
    "random": ("cxrdr.teachers.random_tiny", "load_random_teacher"),
}
VALID_SPECS = ("biomedclip[:DIR]", "openclip:ARCH[:PRETRAINED_OR_PATH]", "ckpt:PATH",
               "text:minilm", "text:PATH", "random:tiny")
_NEEDS_ARG = {"openclip", "ckpt", "text", "random"}

__all__ = ["Teacher", "TeacherError", "VALID_SPECS", "load_teacher", "load_teachers", "parse_spec",
           "split_specs", "weights_fingerprint"]


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
    if scheme not in _REGISTRY:
        raise TeacherError(f"unknown teacher spec {spec!r}; valid specs: {', '.join(VALID_SPECS)}")
    if scheme in _NEEDS_ARG and not arg:
        raise TeacherError(f"teacher spec {spec!r} needs an argument; valid specs: {', '.join(VALID_SPECS)}")
    return scheme, arg, options


def split_specs(specs: str | list[str]) -> list[str]:
    """'a,b' or ['a', 'b'] -> ['a', 'b'] (blank entries dropped)."""
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    return [item.strip() for item in items if item and item.strip()]


def load_teacher(spec: str, device: str = "cpu", model_cache: str | None = None) -> Teacher:
    """Load one teacher from its spec (see module docstring), frozen, in eval mode, on ``device``."""
    scheme, arg, options = parse_spec(spec)
    module_name, func_name = _REGISTRY[scheme]
    loader = getattr(importlib.import_module(module_name), func_name)
    teacher = loader(arg, spec=spec.strip(), device=str(device), model_cache=model_cache, options=options)
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
        raise TeacherError(f"no teacher specs given; valid specs: {', '.join(VALID_SPECS)}")
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
