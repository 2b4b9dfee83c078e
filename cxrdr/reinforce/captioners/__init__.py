"""Captioners: plug-ins that write a build's synthetic captions from the teachers' image embeddings.

Without ``--captioner`` a build's captions come from each record's own text (``cxrdr.reinforce.captions``:
report sentences, RDF and label templates), made in the preparing workers. With ``--captioner SCHEME:ARG``
they are made in the build's process after the image forwards, per stored view, so an image without a
report still gets captions (MobileCLIP's synthetic captions). A registry keyed by the spec's scheme, like
the teachers', so another kind (e.g. a generative CoCa captioner) is one ``register_captioner`` call and no
change to the build:

| spec | what |
|---|---|
| ``retrieval:BANK[?teacher=NAME&max_sentences=N]`` | top-S sentences of a sentence bank by cosine to each view's image embedding (``retrieval``) |

A loader is ``loader(arg, spec=..., teachers=[loaded Teacher], records=[the build's Record], options={})``
and returns an object with:

- ``name`` (the scheme), ``spec``, ``caption_source`` (what ``meta["caption_source"]`` and each caption's
  ``source`` say, e.g. ``retrieved``), ``teacher`` (the name of the image-text teacher whose image rows it reads);
- ``describe() -> dict`` (dataset.json ``captioner``; it must change whenever the captions would);
- ``write(out_dir)``: its artefacts beside the shards (the retrieval bank: ``caption-bank/``);
- ``view_captions(image_rows (K, D), n) -> [[(text, score, bank_id)] * n] * K`` for one sample, best first;
- ``report_for(image_rows (K, D), n) -> str``: the text of a record that has no report.

``cxrdr.reinforce.captioners.views.attach_view_captions`` turns its answer into the sample's json fields.
"""
from __future__ import annotations

from typing import Callable

from cxrdr.common.errors import UserError
from cxrdr.reinforce.captioners.retrieval import load_retrieval_captioner

Loader = Callable[..., object]
_REGISTRY: dict[str, Loader] = {"retrieval": load_retrieval_captioner}
VALID_SPECS = ("retrieval:train", "retrieval:PATH.jsonl|PATH.txt")


def register_captioner(scheme: str, loader: Loader) -> None:
    """Make ``SCHEME:ARG`` captioner specs load with ``loader`` (see the module docstring)."""
    _REGISTRY[scheme.strip().lower()] = loader


def known_captioners() -> list[str]:
    return sorted(_REGISTRY)


def parse_captioner_spec(spec: str) -> tuple[str, str, dict]:
    """'retrieval:train?teacher=x' -> ('retrieval', 'train', {'teacher': 'x'}); UserError naming the valid specs."""
    text = (spec or "").strip()
    options: dict[str, str] = {}
    if "?" in text:
        text, _, query = text.partition("?")
        for item in filter(None, query.split("&")):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise UserError(f"--captioner {spec}: bad option {item!r}, expected key=value")
            options[key.strip()] = value.strip()
    scheme, _, arg = text.partition(":")
    scheme = scheme.strip().lower()
    if scheme not in _REGISTRY:
        raise UserError(f"--captioner {spec}: unknown captioner {scheme!r}; valid: {', '.join(VALID_SPECS)}")
    if not arg.strip():
        raise UserError(f"--captioner {spec}: {scheme} needs an argument after ':'; valid: {', '.join(VALID_SPECS)}")
    return scheme, arg.strip(), options


def load_captioner(spec: str, teachers: list, records: list):
    """The captioner of ``spec`` for a build with these loaded ``teachers`` and source ``records``."""
    scheme, arg, options = parse_captioner_spec(spec)
    return _REGISTRY[scheme](arg, spec=spec.strip(), teachers=teachers, records=records, options=options)


__all__ = ["VALID_SPECS", "known_captioners", "load_captioner", "parse_captioner_spec", "register_captioner"]
