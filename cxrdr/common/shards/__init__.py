"""The shard contract: what ``reinforce build`` (stage 1) writes and ``train`` (stage 2) reads.

Both stages name files, assign keys, encode/decode metadata and embeddings and read tars only through
this package, so writer and readers cannot drift. ``shards/FORMAT.md`` says the same in prose.

Folder (``members``): ``shard-NNNNNN.tar.gz`` (WebDataset tars as one gzip stream, the default) or
``shard-NNNNNN.tar`` (``--compression none``), numbered from 0, never mixing splits; ``dataset.json`` (read with :func:`read_dataset_info`), ``manifest.parquet`` (one row
per sample), ``sizes.json`` ({tar: samples}), ``README.md`` (dataset card) and ``stats/`` (the
build's bookkeeping: plan, per-shard stats with CRC-32 of every member, rank timings).

Sample (``<key>.<ext>`` members; key rules in ``keys``: :func:`safe_key` of the record id, a
short sha1 suffix when two ids sanitise alike):
- ``jpg`` | ``png``: the stored image, 8-bit grayscale, short side ``store_size`` (absent when
  dataset.json ``images`` is false);
- ``txt``: the report (UTF-8), the text of the ``txt`` embedding row;
- ``json``: metadata ``{"id", "key", "subject_id", "study_id", "split", "view", "findings",
  "impression", "labels" {CheXpert-14 name: 1|0|-1|-2 not mentioned}, "label_vector" [14], "triples",
  "captions" [{"text", "source"}] (S), "aug" [params] (K), "boxes" [{"label", "box", "extra"}],
  "image_size", "extra" (JSON text)}``, every field always present in one type (``meta``:
  :data:`META_TYPES`, :func:`encode_meta` writes it, :func:`decode_meta` gives readers the meaning
  they use: labels None when not mentioned, ``extra`` a dict, ...). A build with a captioner
  (dataset.json ``captioner``, ``reinforce build --captioner retrieval:BANK``) stores in ``captions``
  the distinct captions of all K views (S..K*S, source ``retrieved``) and adds, in every sample,
  :data:`CAPTIONER_META_TYPES`: ``caption_source``, ``caption_views`` (K lists of S indexes into
  ``captions``), ``caption_scores`` (K lists of S cosines), ``caption_bank_ids`` (each caption's row
  of ``caption-bank/sentences.npy``);
- ``<teacher>.npy``: the teacher's rows img (K, image-text teachers of image builds only),
  syn (one per caption: S, or the sample's count in a captioner build), txt (1), L2-normalised
  before storage.

Embedding encodings (``embeddings``): float16 / float32 ``(R, D)``; int8 a structured ``(R,)``
array of ``(q int8[D], scale float32)`` records, value = q * scale.

Schema versions: builds write 3; readers accept 1, 2 and 3. Schema 2 differs only in the json member:
the meaning as stored (nulls, ``extra`` an object, ops ``[name, magnitude]``; :func:`decode_meta`
passes it through). Schema 1 differs from 2 in the embeddings: ``<teacher>.<part>.npy`` per part,
int8 scales in ``<teacher>.<part>.scale.npy``.

Reading (``reader``): :func:`iter_tar_samples` (strict: truncation and duplicates are errors),
:func:`decode_sample` -> :class:`Sample` (meta, report, image, embeddings).
"""
from cxrdr.common.shards.embeddings import (decode_embedding, encode_embedding, encode_rows, encode_teacher,
                                            int8_row_dtype, merge_int8_quality, npy_bytes, npy_load,
                                            repack_v1_teacher, sample_embedding, sample_embeddings, split_rows,
                                            stack_parts)
from cxrdr.common.shards.info import MissingDatasetError, dataset_identity, read_dataset_info
from cxrdr.common.shards.keys import assign_keys, check_unique_keys, safe_key
from cxrdr.common.shards.members import (DATASET_JSON, EMB_DTYPES, EMB_PARTS, IMAGE_EXTS, MANIFEST,
                                         READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, SHARD_PATTERN, SHARD_RE,
                                         SHARD_SUFFIXES, SIZES_JSON, STATS_DIR, TEACHER_NAME_RE, emb_ext, expected_members,
                                         part_of, scale_ext, shard_compression, shard_index, shard_name,
                                         shard_stats_path,
                                         teacher_ext, teacher_shapes)
from cxrdr.common.shards.meta import (CAPTIONER_META_TYPES, LABEL_NOT_MENTIONED, META_TYPES, check_stored_meta,
                                      decode_meta, encode_meta, hf_features, load_meta, meta_member, meta_types,
                                      with_caption_provenance)
from cxrdr.common.shards.reader import Sample, decode_sample, iter_raw_samples, iter_tar_samples

__all__ = [
    "CAPTIONER_META_TYPES", "DATASET_JSON", "EMB_DTYPES", "EMB_PARTS", "IMAGE_EXTS", "LABEL_NOT_MENTIONED", "MANIFEST", "META_TYPES",
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION", "SHARD_PATTERN", "SHARD_RE", "SHARD_SUFFIXES", "SIZES_JSON", "STATS_DIR", "TEACHER_NAME_RE",
    "MissingDatasetError", "Sample", "assign_keys", "check_stored_meta", "check_unique_keys", "dataset_identity",
    "decode_embedding", "decode_meta", "decode_sample", "encode_meta", "hf_features", "load_meta", "meta_member", "meta_types",
    "with_caption_provenance",
    "emb_ext", "encode_embedding", "encode_rows", "encode_teacher", "expected_members", "int8_row_dtype",
    "iter_raw_samples", "iter_tar_samples", "merge_int8_quality", "npy_bytes", "npy_load", "part_of",
    "read_dataset_info", "repack_v1_teacher", "safe_key", "sample_embedding", "sample_embeddings",
    "scale_ext", "shard_compression", "shard_index", "shard_name", "shard_stats_path", "split_rows", "stack_parts", "teacher_ext", "teacher_shapes",
]
