"""Sample assembly: a prepared record and its embeddings -> the tar members of one sample."""
from __future__ import annotations

from cxrdr.common.shards import encode_teacher, merge_int8_quality, meta_member, teacher_ext


def assemble_sample(prepared: dict, embeddings: dict, image_format: str, emb_dtype: str,
                    errors: dict, cosines: dict | None = None) -> dict:
    """The tar members of one sample (``prepared["meta"]`` is the json member's stored object; one
    ``<teacher>.npy`` per teacher); updates ``errors`` with int8 max abs errors and ``cosines`` with
    int8 lowest cosines per teacher."""
    meta = prepared["meta"]
    sample = {"__key__": prepared["key"], "txt": prepared["report"].encode("utf-8"),
              "json": meta_member(meta)}
    if prepared["image"] is not None:
        sample[image_format] = prepared["image"]
    for teacher, parts in embeddings.items():
        data, quality = encode_teacher(parts, emb_dtype, len(meta["aug"]), len(meta["captions"]))
        sample[teacher_ext(teacher)] = data
        merge_int8_quality(errors, cosines if cosines is not None else {}, teacher, quality)
    return sample
