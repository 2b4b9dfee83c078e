"""The ``json`` member: a sample's metadata as cxrdr uses it <-> as schema 3 stores it.

Hugging Face ``datasets`` gives each field of the json member one Arrow type, inferred from the first
few samples of a shard: a field that is null or an empty list there (a label not mentioned, a study
without boxes) cannot hold the ints or lists that come later, a key first seen later is dropped, an int
where floats came first truncates the floats, and a list mixing strings and numbers has no type at all.
So schema 3 stores every field in one type that does not depend on the sample, :data:`META_TYPES`:
every key always present, no nulls, numbers in their declared type, and what varies by source
(``extra``, a box's fields besides label and box) as JSON text. The dataset card declares the same
types (:func:`hf_features`), so even lists empty in the first samples are typed.

In memory every reader keeps the meaning schema 1 and 2 stored as it is (:func:`decode_meta`): labels
None when not mentioned, ``view``/``image_size`` None when unknown, ``extra`` a dict (absent when
empty), augmentation ``ops`` as ``[name, magnitude]`` pairs (what ``cxrdr.common.augment.replay``
reads). :func:`encode_meta` is the writer's way from that to the stored form. Both live here only.
"""
from __future__ import annotations

import json
import numbers

from cxrdr.common.labels import CHEXPERT14
from cxrdr.common.shards.members import teacher_ext

LABEL_NOT_MENTIONED = -2  # stored label code for "not mentioned" (None in memory); 1, 0, -1 as they are

# One augmentation parameter set (cxrdr.common.augment's layout; ops as records, not [name, value] pairs)
AUG_TYPES = {"crop": ["float64"], "angle": "float64", "hflip": "bool", "brightness": "float64",
             "contrast": "float64", "gamma": "float64", "ops": [{"name": "string", "magnitude": "float64"}],
             "noise_seed": "int64"}
# The stored json member, field -> type: "string", "int64", "float64", "bool"; [T] a list of T;
# {key: T} an object with exactly these keys. Key order is the order the build writes.
META_TYPES = {
    "id": "string", "key": "string", "subject_id": "string", "study_id": "string", "split": "string",
    "view": "string",  # "" unknown
    "findings": "string", "impression": "string",
    "labels": {name: "int64" for name in CHEXPERT14},  # 1, 0, -1, LABEL_NOT_MENTIONED
    "label_vector": ["float64"],
    "triples": [["string"]],
    "captions": [{"text": "string", "source": "string"}],
    "aug": [AUG_TYPES],
    "boxes": [{"label": "string", "box": ["float64"], "extra": "string"}],  # extra: JSON object text
    "image_size": ["int64"],  # [] without an image
    "extra": "string",  # JSON object text, "{}" when none
}
# Caption provenance, written by a build with a captioner (dataset.json ``captioner``, e.g. retrieval):
# present in every sample of such a build and in none of any other build, so a build without one writes
# exactly the bytes it wrote before (and readers of older folders see nothing new).
CAPTIONER_META_TYPES = {
    "caption_source": "string",  # how the captions were made: "retrieved"
    "caption_views": [["int64"]],  # K lists of S indexes into captions: view k's captions, best first
    "caption_scores": [["float64"]],  # K lists of S cosines: view k's teacher image embedding vs that caption
    "caption_bank_ids": ["int64"],  # per caption: its row in the build's caption-bank/sentences.npy
}


def meta_types(captioned: bool = False) -> dict:
    """The json member's field types: :data:`META_TYPES`, plus :data:`CAPTIONER_META_TYPES` in a build
    with a captioner."""
    return {**META_TYPES, **CAPTIONER_META_TYPES} if captioned else META_TYPES


def _captioned(obj: dict) -> bool:
    return any(key in obj for key in CAPTIONER_META_TYPES)


def encode_meta(meta: dict) -> dict:
    """In-memory metadata (schema-2 meaning) -> the schema-3 json member's object (:data:`META_TYPES`).

    ValueError naming the field when a value does not fit its type (a build skips that record)."""
    try:
        stored = _stored_fields(meta)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"json: {type(exc).__name__}: {exc}") from None
    return _conform(stored, meta_types(_captioned(meta)), "json")


def with_caption_provenance(stored: dict, captions: list[dict], provenance: dict) -> dict:
    """A stored json object (:func:`encode_meta`) with the captioner's ``captions`` and its
    :data:`CAPTIONER_META_TYPES` fields (``provenance``) in their declared types (ValueError otherwise)."""
    out = {**stored, "captions": captions, **provenance}
    return _conform(out, meta_types(True), "json")


def _stored_fields(meta: dict) -> dict:
    """The fields whose stored form differs from their meaning (the rest are checked by _conform)."""
    stored = dict(meta)
    for field in ("view", "findings", "impression"):
        stored[field] = meta.get(field) or ""
    labels = meta.get("labels") or {}
    unknown = sorted(set(labels) - set(CHEXPERT14))
    if unknown:
        raise ValueError(f"json.labels: not CheXpert-14 names: {unknown}")
    stored["labels"] = {name: _label_code(labels.get(name), name) for name in CHEXPERT14}
    stored["aug"] = [{**params, "ops": [{"name": name, "magnitude": value} for name, value in params.get("ops") or []]}
                     for params in meta.get("aug") or []]
    stored["boxes"] = [_stored_box(box) for box in meta.get("boxes") or []]
    stored["image_size"] = meta.get("image_size") or []
    stored["extra"] = _json_text(meta.get("extra") or {})
    return stored


def decode_meta(stored: dict) -> dict:
    """A stored json member's object (any readable schema) -> the metadata every cxrdr reader uses.

    Schema 1 and 2 stored that meaning as it is (``extra`` absent or an object) and come back unchanged;
    schema 3 (``extra`` JSON text) is turned back. ValueError when a schema-3 object is malformed."""
    if not isinstance(stored.get("extra"), str):
        return stored
    try:
        meta = dict(stored)
        meta["view"] = stored["view"] or None
        meta["labels"] = {k: None if v == LABEL_NOT_MENTIONED else v for k, v in stored["labels"].items()}
        meta["aug"] = [{**params, "ops": [[op["name"], op["magnitude"]] for op in params["ops"]]}
                       for params in stored["aug"]]
        meta["boxes"] = [{"label": b["label"], "box": b["box"], **json.loads(b["extra"])} for b in stored["boxes"]]
        meta["image_size"] = stored["image_size"] or None
        extra = json.loads(meta.pop("extra"))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"schema-3 json member does not decode ({type(exc).__name__}: {exc})") from None
    if extra:
        meta["extra"] = extra
    return meta


def load_meta(data) -> dict:
    """A json member's bytes -> :func:`decode_meta` of it (ValueError when it is not a JSON object)."""
    stored = json.loads(data)
    if not isinstance(stored, dict):
        raise ValueError("the json member is not an object")
    return decode_meta(stored)


def check_stored_meta(stored: dict, captioned: bool | None = None) -> None:
    """ValueError naming the first field of a schema-3 json member's object that is missing, unknown or
    not exactly of its declared type (an int where floats are declared counts: Arrow would type it apart).
    ``captioned``: whether the build had a captioner (its fields are then required, else unknown);
    None: whether the object holds any of them."""
    captioned = _captioned(stored) if captioned is None else captioned
    _conform(stored, meta_types(captioned), "json", strict=True)


def meta_member(stored: dict) -> bytes:
    """The json member's bytes of an :func:`encode_meta` object (UTF-8 JSON)."""
    return json.dumps(stored, ensure_ascii=False).encode("utf-8")


def hf_features(info: dict) -> list[dict] | None:
    """Hugging Face ``datasets`` features of every member of a sample of the build ``info`` describes,
    as the dataset card's ``dataset_info.features`` YAML list; None before schema 3 (json types vary).

    int8 embedding members (structured rows, which Arrow cannot hold) are left out, so ``datasets``
    loads such a build without them."""
    if info.get("schema_version", 1) < 3:
        return None
    features = [{"name": "__key__", "dtype": "string"}, {"name": "__url__", "dtype": "string"}]
    if info.get("images", True):
        features.append({"name": info["image_format"], "dtype": "image"})
    features += [{"name": "txt", "dtype": "string"},
                 {"name": "json", **_hf_feature(meta_types(bool(info.get("captioner"))))}]
    if info.get("emb_dtype") in ("float16", "float32"):
        features += [{"name": teacher_ext(t["name"]), **_hf_feature([[info["emb_dtype"]]])} for t in info["teachers"]]
    return features


def _hf_feature(kind) -> dict:
    """One :data:`META_TYPES` type in the YAML layout of ``datasets.Features``."""
    if isinstance(kind, dict):
        return {"struct": [{"name": key, **_hf_feature(value)} for key, value in kind.items()]}
    if isinstance(kind, list):
        inner = _hf_feature(kind[0])
        return {"list": inner.get("dtype") or inner.get("struct") or inner}
    return {"dtype": kind}


def _label_code(value, name: str) -> int:
    if value is None:
        return LABEL_NOT_MENTIONED
    if value not in (1, 0, -1) or isinstance(value, bool):
        raise ValueError(f"json.labels.{name}: {value!r} is not 1, 0, -1 or None")
    return int(value)


def _stored_box(box: dict) -> dict:
    if not isinstance(box, dict) or "box" not in box:
        raise ValueError(f"json.boxes: {box!r} is not an object with a box")
    rest = {k: v for k, v in box.items() if k not in ("label", "box")}
    label = box.get("label", "")
    if not isinstance(label, str):  # kept exactly, in extra (decode_meta lets extra's label win)
        rest["label"] = label
    return {"label": str(label), "box": box["box"], "extra": _json_text(rest)}


def _json_text(value: dict) -> str:
    if not isinstance(value, dict):
        raise ValueError(f"json.extra: {type(value).__name__}, not an object")
    return json.dumps(value, ensure_ascii=False, default=str)


def _conform(value, kind, where: str, strict: bool = False):
    """``value`` in the type ``kind`` (ints as floats where floats are declared; ``strict``: only values
    already of exactly that type); ValueError otherwise."""
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {type(value).__name__}, not an object")
        missing, unknown = sorted(set(kind) - set(value)), sorted(set(value) - set(kind))
        if missing or unknown:
            raise ValueError(f"{where}: keys missing {missing}, unknown {unknown}")
        return {key: _conform(value[key], sub, f"{where}.{key}", strict) for key, sub in kind.items()}
    if isinstance(kind, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: {type(value).__name__}, not a list")
        return [_conform(item, kind[0], f"{where}[{i}]", strict) for i, item in enumerate(value)]
    if strict and type(value) is not _EXACT[kind]:
        raise ValueError(f"{where}: {value!r} is a {type(value).__name__}, not {kind}")
    return _SCALARS[kind](value, where)


def _string(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real):  # a number where text is declared (e.g. a box label 5): its text
        return str(value)
    raise ValueError(f"{where}: {value!r} is not a string")


def _float(value, where: str) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{where}: {value!r} is not a number")


def _int(value, where: str) -> int:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{where}: {value!r} is not an integer")


def _bool(value, where: str) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise ValueError(f"{where}: {value!r} is not a boolean")


_SCALARS = {"string": _string, "float64": _float, "int64": _int, "bool": _bool}
_EXACT = {"string": str, "float64": float, "int64": int, "bool": bool}
