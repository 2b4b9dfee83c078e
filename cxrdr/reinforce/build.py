"""`reinforce build`: records -> replayable augmentations + captions + teacher embeddings -> shards.

Pipeline (one rank):
1. The main process enumerates the source's records (text level only; the source skips bad
   ones into its SkipLog), orders them train, val, test (source order inside a split) and cuts
   shards of ``--shard-size`` records that never mix splits. Boundaries are fixed before any
   image work, so every rank and every ``--resume`` agree on them (``stats/plan.json``).
2. DataLoader workers decode each image, resize it to short side ``--store-size``, ENCODE it
   (JPEG/PNG) and DECODE it again, so the teacher sees exactly the pixels stage 2 will decode;
   then sample K augmentation parameter sets, replay them (``replay_many``: bit-identical to one
   ``replay`` per set, shared work done once) at every distinct teacher input size, and make S
   captions. An unreadable image is skipped into the build's SkipLog, never fatal. Workers hand
   over chunks of about B/(2*workers) records with their crops in one tensor per size.
3. The main process regroups the chunks into batches of B = ``--batch-size`` records and runs
   the teacher forwards (K*B crops per image forward; reports + captions per text forward).
4. A background thread writes the tar (bounded queue), as ``shard-NNNNNN.tar.tmp`` renamed
   with its ``stats/shard-NNNNNN.json`` when complete.
5. Rank 0 waits for every shard of the plan, then merges manifest.parquet, sizes.json and
   dataset.json (``cxrdr.reinforce.manifest.merge``).

Shard ``i`` belongs to rank ``i % world_size`` (from ``--rank/--world-size`` or torchrun's
RANK/WORLD_SIZE). ``--engine ray`` instead builds the pending shards of steps 2-4 on a Ray
actor pool with this module's own ``_run_shards`` (reinforce.ray_engine); same plan, same bytes.
The format is described in shards/FORMAT.md.
"""
from __future__ import annotations

import gc
import hashlib
import io
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.common.errors import UserError
from cxrdr.common.locking import lock_build_rank, plan_lock, remove_stale_temp_files

DEFAULT_OUT = Path("shards")


def read_dataset_info(shards_dir) -> dict:
    """Load ``dataset.json`` of a shard folder (what stage 2 reads before streaming)."""
    from cxrdr.common.shards import DATASET_JSON, READABLE_SCHEMA_VERSIONS

    path = Path(shards_dir) / DATASET_JSON
    if not path.is_file():
        hint = (" (the build has not been merged yet: run `reinforce merge " f"{shards_dir}`)"
                if (Path(shards_dir) / "stats" / "plan.json").is_file() else
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


class MissingDatasetError(UserError, FileNotFoundError):
    """dataset.json is missing (both a UserError for the CLI and a FileNotFoundError for callers)."""


# --------------------------------------------------------------------------- options & plan


@dataclass
class BuildOptions:
    source: str = "phantom"
    teachers: str = "random:tiny"
    out: Path = DEFAULT_OUT
    n_aug: int = 10
    n_captions: int = 5
    store_size: int = 256
    image_format: str = "jpg"
    jpeg_quality: int = 95
    emb_dtype: str = "float16"
    shard_size: int = 1000
    seed: int = 0
    workers: int = 2
    batch_size: int = 32
    device: str = "auto"
    model_cache: Optional[str] = None
    resume: bool = False
    rank: Optional[int] = None
    world_size: Optional[int] = None
    limit: Optional[int] = None
    aug: object = None  # AugConfig; None -> defaults
    source_options: dict = field(default_factory=dict)
    merge_timeout: float = 3600.0
    progress: bool = True
    engine: str = "local"  # local (this process, or torchrun ranks) or ray (reinforce.ray_engine)
    ray_actors: Optional[int] = None  # default: one per GPU of the cluster, else CPUs / max(1, workers)
    ray_retries: int = 3


@dataclass
class ShardPlan:
    index: int
    split: str
    items: list  # [(key, Record)]

    @property
    def name(self) -> str:
        from cxrdr.common.shards import shard_name

        return shard_name(self.index)

    def describe(self) -> dict:
        ids = hashlib.sha1("\n".join(r.id for _, r in self.items).encode()).hexdigest()[:16]
        return {"index": self.index, "name": self.name, "split": self.split,
                "records": len(self.items), "ids_sha1": ids}


def assign_keys(records) -> list[tuple[str, object]]:
    """Unique WebDataset keys: safe_key(id), plus a short id hash when two ids sanitise alike.

    Unique by construction: the first record of each sanitised key keeps it, and a later one's
    hashed key must avoid every sanitised key of the whole list (ids 'x', 'x-914ba315', 'x.'
    would otherwise give 'x-914ba315' twice) and every key given so far; if it does not, the hash
    grows (then a counter is added), all deterministic in the list of ids.
    """
    from cxrdr.reinforce.records import safe_key

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


def cut_shards(keyed_records, shard_size: int) -> list[ShardPlan]:
    """Order by split (train, val, test), keep source order inside a split, never mix splits."""
    from cxrdr.reinforce.records import iter_splits

    keys = {id(rec): key for key, rec in keyed_records}
    shards: list[ShardPlan] = []
    for split, recs in iter_splits([rec for _, rec in keyed_records]):
        for start in range(0, len(recs), shard_size):
            chunk = recs[start:start + shard_size]
            shards.append(ShardPlan(len(shards), split, [(keys[id(r)], r) for r in chunk]))
    return shards


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """--rank/--world-size, else torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    if world_size < 1 or not 0 <= rank < world_size:
        raise UserError(f"invalid rank {rank} for world size {world_size} (need 0 <= rank < world size)")
    return rank, world_size


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    return device


# --------------------------------------------------------------------------- worker side


@dataclass
class PrepareSpec:
    """Everything a DataLoader worker needs to prepare one record (picklable)."""

    images: bool
    store_size: int
    image_format: str
    jpeg_quality: int
    n_aug: int
    n_captions: int
    aug: object
    seed: int
    sizes: tuple  # distinct teacher input sizes


def encode_image(image, image_format: str, jpeg_quality: int) -> bytes:
    buf = io.BytesIO()
    if image_format == "png":
        image.save(buf, format="PNG")
    else:
        image.save(buf, format="JPEG", quality=jpeg_quality)
    return buf.getvalue()


def decode_stored_image(data: bytes):
    """Stored image bytes -> PIL 'L', exactly as stage 2 decodes them (PIL)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("L")


def _scale_boxes(boxes, orig_size, stored_size) -> list[dict]:
    sx, sy = stored_size[0] / orig_size[0], stored_size[1] / orig_size[1]
    out = []
    for b in boxes or []:
        x0, y0, x1, y1 = b["box"]
        out.append({**b, "box": [round(x0 * sx, 2), round(y0 * sy, 2), round(x1 * sx, 2), round(y1 * sy, 2)]})
    return out


def _json_safe(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))


def prepare_record(shard: int, key: str, record, spec: PrepareSpec) -> dict:
    """Decode/encode/decode, sample + replay augmentations, make captions. Never raises."""
    import numpy as np

    from cxrdr.common.augment import replay_many, resize_short_side, sample_param_sets
    from cxrdr.reinforce.captions import make_captions
    from cxrdr.reinforce.records import CHEXPERT14, load_image

    start = time.perf_counter()
    out = {"shard": shard, "key": key, "id": record.id}
    image_bytes, params, crops, size, boxes = None, [], {}, None, []
    # CPU seconds per step (process time: on a busy machine wall time would count other processes).
    stages: dict[str, float] = {}
    cpu = time.process_time()
    if spec.images:
        try:
            image = load_image(record)
        except FileNotFoundError as exc:
            return {**out, "skip": f"missing image: {exc}", "prep_seconds": time.perf_counter() - start}
        except Exception as exc:  # noqa: BLE001 - any decoder error means "unreadable", not a crash
            return {**out, "skip": f"unreadable image: {type(exc).__name__}: {exc}",
                    "prep_seconds": time.perf_counter() - start}
        orig_size = image.size
        image = resize_short_side(image, spec.store_size)
        t = time.process_time()
        stages["load_resize"] = t - cpu
        image_bytes = encode_image(image, spec.image_format, spec.jpeg_quality)
        stored = decode_stored_image(image_bytes)
        stages["encode_decode"] = time.process_time() - t
        t = time.process_time()
        size = list(stored.size)
        params = sample_param_sets(key, size[0], size[1], spec.n_aug, spec.aug, spec.seed)
        # replay_many == stacking replay() calls bit for bit (tests/test_augment.py), ~4x cheaper.
        pixels = np.asarray(stored)
        crops = {s: replay_many(pixels, params, s) for s in spec.sizes}
        boxes = _scale_boxes(record.boxes, orig_size, size)
        stages["params_replay"] = time.process_time() - t
    t = time.process_time()
    try:
        captions = [c.to_json() for c in make_captions(record, n=spec.n_captions, seed=spec.seed)]
    except Exception as exc:  # noqa: BLE001
        return {**out, "skip": f"captions failed: {type(exc).__name__}: {exc}",
                "prep_seconds": time.perf_counter() - start}
    if len(captions) != spec.n_captions:
        return {**out, "skip": f"captions failed: got {len(captions)} captions, expected {spec.n_captions}",
                "prep_seconds": time.perf_counter() - start}
    stages["captions"] = time.process_time() - t
    labels = {name: record.labels.get(name) for name in CHEXPERT14}
    meta = {"id": record.id, "key": key, "subject_id": str(record.subject_id),
            "study_id": str(record.study_id), "split": record.split, "view": record.view,
            "findings": record.findings, "impression": record.impression, "labels": labels,
            "label_vector": record.label_vector(), "triples": [list(t) for t in record.triples],
            "captions": captions, "aug": params, "boxes": boxes, "image_size": size}
    if record.extra:
        meta["extra"] = _json_safe(record.extra)
    row = {"key": key, "id": record.id, "split": record.split, "subject_id": str(record.subject_id),
           "study_id": str(record.study_id), "view": record.view, **labels,
           "n_aug": len(params), "n_captions": len(captions)}
    return {**out, "image": image_bytes, "report": record.report, "meta": meta, "row": row,
            "crops": crops, "texts": [record.report] + [c["text"] for c in captions],
            "prep_seconds": time.perf_counter() - start,
            "stage_seconds": {**stages, "rest": time.process_time() - cpu - sum(stages.values())}}


class _PrepareDataset:
    """Map-style dataset over (shard, key, record) for torch's DataLoader."""

    def __init__(self, items, spec: PrepareSpec):
        self.items, self.spec = items, spec

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        shard, key, record = self.items[i]
        return prepare_record(shard, key, record, self.spec)


def collate_prepared(batch: list[dict]) -> dict:
    """Worker-side collate: one (sum K, 1, S, S) crop tensor per teacher size for the batch's
    usable samples, so the main process gets one shared-memory tensor per size (not one per
    sample) and does not have to concatenate them before the forward."""
    import torch

    ok = [b for b in batch if "skip" not in b]
    crops = {}
    if ok and ok[0].get("crops"):
        crops = {size: torch.cat([b["crops"][size] for b in ok]) for size in ok[0]["crops"]}
    for b in ok:
        b.pop("crops", None)
    return {"samples": batch, "crops": crops}


# --------------------------------------------------------------------------- main-process side


def _forward(fn, inputs, chunk: int = 512):
    import torch

    outs = [fn(inputs[i:i + chunk]) for i in range(0, len(inputs), chunk)]
    return torch.cat(outs).numpy() if outs else None


def embed_batch(teachers, samples: list[dict], images: bool, crops: dict | None = None) -> list[dict]:
    """Teacher forwards for a batch: per sample {teacher: {'img': (K,D), 'syn': (S,D), 'txt': (D,)}}.

    ``crops``: the samples' crops already concatenated per teacher size ({size: (B*K, 1, S, S)},
    from :func:`collate_prepared`); default: each sample's own ``sample["crops"][size]`` (K, 1, S, S).
    """
    import torch

    out = [{} for _ in samples]
    if not samples:
        return out
    n_syn = len(samples[0]["texts"]) - 1
    texts = [s["texts"][0] for s in samples] + [t for s in samples for t in s["texts"][1:]]
    for teacher in teachers:
        if images and teacher.has_images:
            if crops is not None:
                x = crops[teacher.image_size]
            else:
                x = torch.cat([s["crops"][teacher.image_size] for s in samples])
            img = _forward(teacher.encode_images, x)
            img = img.reshape(len(samples), x.shape[0] // len(samples), -1)
        txt_all = _forward(teacher.encode_texts, texts)
        txt, syn = txt_all[:len(samples)], txt_all[len(samples):].reshape(len(samples), n_syn, -1)
        for i in range(len(samples)):
            parts = {"syn": syn[i], "txt": txt[i]}
            if images and teacher.has_images:
                parts["img"] = img[i]
            out[i][teacher.name] = parts
    return out


def assemble_sample(prepared: dict, embeddings: dict, image_format: str, emb_dtype: str,
                    errors: dict, cosines: dict | None = None) -> dict:
    """The tar members of one sample (schema 2: one ``<teacher>.npy`` per teacher); updates
    ``errors`` with int8 max abs errors and ``cosines`` with int8 lowest cosines per teacher."""
    from cxrdr.common.shards import encode_teacher, merge_int8_quality, teacher_ext

    meta = prepared["meta"]
    sample = {"__key__": prepared["key"], "txt": prepared["report"].encode("utf-8"),
              "json": json.dumps(meta, ensure_ascii=False).encode("utf-8")}
    if prepared["image"] is not None:
        sample[image_format] = prepared["image"]
    for teacher, parts in embeddings.items():
        data, quality = encode_teacher(parts, emb_dtype, len(meta["aug"]), len(meta["captions"]))
        sample[teacher_ext(teacher)] = data
        merge_int8_quality(errors, cosines if cosines is not None else {}, teacher, quality)
    return sample


def _run_shards(todo: list[ShardPlan], teachers, spec: PrepareSpec, opts: BuildOptions, out_dir: Path,
                skiplog, fail_after_shards: int | None, rank: int) -> dict:
    """Prepare (workers) -> embed (main) -> write (thread) for this rank's pending shards."""
    import torch
    from tqdm import tqdm

    from cxrdr.reinforce.writer import BackgroundWriter

    items = [(s.index, key, rec) for s in todo for key, rec in s.items]
    remaining = {s.index: len(s.items) for s in todo}
    splits = {s.index: s.split for s in todo}
    timing = {"decode_augment": 0.0, "teacher": 0.0, "write": 0.0, "loader_wait": 0.0}
    assemble_seconds = 0.0  # main process: packing samples and queueing them to the writer
    stage_seconds: dict[str, float] = {}  # worker CPU seconds per preparation step
    main_cpu = {"teacher": 0.0, "assemble": 0.0}  # main-thread CPU seconds (wall lies on a busy machine)
    built = 0
    if not items:
        return {"samples_built": 0, "pipeline_seconds": 0.0, "time_split_seconds": timing}
    started = time.perf_counter()

    done_count = [0]

    def on_shard_done(stats):
        done_count[0] += 1
        if fail_after_shards is not None and done_count[0] >= fail_after_shards:
            raise SimulatedKill(f"simulated kill after {done_count[0]} shard(s)")

    # Workers prepare chunks smaller than a teacher batch, so all of them work on the first batch
    # (a whole batch per worker would leave the teacher idle for a full batch's preparation at
    # the start). The main process regroups the chunks into the same --batch-size batches.
    chunk = _chunk_size(opts.batch_size, opts.workers)
    loader = torch.utils.data.DataLoader(
        _PrepareDataset(items, spec), batch_size=chunk, shuffle=False,
        num_workers=opts.workers, collate_fn=collate_prepared,
        prefetch_factor=max(2, -(-opts.batch_size // chunk)) if opts.workers > 0 else None,
        persistent_workers=False)
    writer = BackgroundWriter(out_dir, maxsize=max(64, 4 * opts.batch_size), on_shard_done=on_shard_done)
    errors: dict[int, dict] = {}
    cosines: dict[int, dict] = {}
    position: dict[int, int] = {}
    current = None
    bar = tqdm(total=len(items), unit="rec", desc=f"build[{rank}]", disable=not opts.progress)
    threads = torch.get_num_threads()
    if not any(str(t.device).startswith("cuda") for t in teachers):
        # CPU teachers share the cores with the workers: oversubscribed intra-op threads spin and
        # halve the build's throughput (measured on 2 cores: 11 -> 28 samples/s with 1 thread).
        torch.set_num_threads(max(1, min(threads, (os.cpu_count() or 1) - opts.workers)))
    if opts.workers > 0:
        # Workers fork when the loop starts and inherit every record; a garbage collection in a
        # worker would touch them all and copy their pages (copy-on-write): measured ~3 ms CPU
        # per sample on phantom:200. Frozen objects are never scanned; unfrozen when the build ends.
        gc.freeze()
    try:
        t_wait = time.perf_counter()
        for collated in _regroup(loader, opts.batch_size):
            timing["loader_wait"] += time.perf_counter() - t_wait
            batch = collated["samples"]
            ok = [b for b in batch if "skip" not in b]
            t0, c0 = time.perf_counter(), time.thread_time()
            embs = embed_batch(teachers, ok, spec.images, crops=collated["crops"])
            t1, c1 = time.perf_counter(), time.thread_time()
            main_cpu["teacher"] += c1 - c0
            timing["teacher"] += t1 - t0
            emb_of = {b["key"]: e for b, e in zip(ok, embs)}
            for b in batch:
                timing["decode_augment"] += b["prep_seconds"]
                for stage, seconds in b.get("stage_seconds", {}).items():
                    stage_seconds[stage] = stage_seconds.get(stage, 0.0) + seconds
                if b["shard"] != current:
                    writer.begin(b["shard"], splits[b["shard"]], remaining[b["shard"]])
                    current = b["shard"]
                if "skip" in b:
                    skiplog.skip(b["id"], b["skip"])
                    writer.skip(b["id"], b["skip"])
                else:
                    sample = assemble_sample(b, emb_of[b["key"]], spec.image_format, opts.emb_dtype,
                                             errors.setdefault(b["shard"], {}),
                                             cosines.setdefault(b["shard"], {}))
                    writer.add(sample, {**b["row"], "shard": _shard_name(b["shard"]),
                                        "index_in_shard": position.get(b["shard"], 0)})
                    position[b["shard"]] = position.get(b["shard"], 0) + 1
                    built += 1
                remaining[b["shard"]] -= 1
                if remaining[b["shard"]] == 0:
                    writer.end({"teachers": [t.name for t in teachers],
                                "int8_max_abs_error": errors.pop(b["shard"], {}) or None,
                                "int8_min_cosine": cosines.pop(b["shard"], {}) or None})
                    current = None
            assemble_seconds += time.perf_counter() - t1
            main_cpu["assemble"] += time.thread_time() - c1
            bar.update(len(batch))
            t_wait = time.perf_counter()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        torch.set_num_threads(threads)
        if opts.workers > 0:
            gc.unfreeze()
    timing["write"] = writer.write_seconds
    return {"samples_built": built, "pipeline_seconds": round(time.perf_counter() - started, 3),
            "time_split_seconds": {k: round(v, 3) for k, v in timing.items()},
            "assemble_seconds": round(assemble_seconds, 3),
            "prepare_cpu_seconds": {k: round(v, 3) for k, v in stage_seconds.items()},
            "main_cpu_seconds": {k: round(v, 3) for k, v in main_cpu.items()}}


def _chunk_size(batch_size: int, workers: int) -> int:
    """Records per worker chunk: about batch_size / (2 * workers), a divisor of batch_size so the
    regrouped batches are exactly the --batch-size batches."""
    if workers <= 0:
        return batch_size
    target = max(1, -(-batch_size // (2 * workers)))
    return max(d for d in range(1, target + 1) if batch_size % d == 0)


def _regroup(chunks, batch_size: int):
    """Concatenate collated chunks into batches of ``batch_size`` records (the last may be short):
    the teacher sees the same batches as with a loader batch size of ``batch_size``."""
    import torch

    pending: list[dict] = []

    def merged() -> dict:
        sizes = {size for c in pending for size in c["crops"]}
        return {"samples": [b for c in pending for b in c["samples"]],
                "crops": {size: torch.cat([c["crops"][size] for c in pending if size in c["crops"]])
                          for size in sizes}}

    count = 0
    for chunk in chunks:
        pending.append(chunk)
        count += len(chunk["samples"])
        if count >= batch_size:
            yield merged()
            pending, count = [], 0
    if pending:
        yield merged()


def _shard_name(index: int) -> str:
    from cxrdr.common.shards import shard_name

    return shard_name(index)


class SimulatedKill(RuntimeError):
    """Raised by the test hook ``fail_after_shards`` to mimic a build killed partway."""


def _open_source(opts: BuildOptions):
    from cxrdr.reinforce.sources import open_source

    options = {k: v for k, v in opts.source_options.items() if v is not None}
    try:
        return open_source(opts.source, **options)
    except UserError as exc:
        raise UserError(f"--source {opts.source}: {exc}") from exc
    except (ValueError, FileNotFoundError, KeyError, OSError, TypeError) as exc:
        raise UserError(f"--source {opts.source}: {exc}") from exc


def _load_teachers(opts: BuildOptions, device: str):
    from cxrdr.common.shards import TEACHER_NAME_RE
    from cxrdr.teachers import load_teachers

    if not opts.teachers or not opts.teachers.strip(","):
        raise UserError("--teachers is empty; give at least one teacher spec (e.g. random:tiny)")
    try:
        teachers = load_teachers(opts.teachers, device=device, model_cache=opts.model_cache)
    except UserError as exc:
        raise UserError(f"--teachers {opts.teachers}: {exc}") from exc
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise UserError(f"--teachers {opts.teachers}: {exc}") from exc
    names = [t.name for t in teachers]
    if len(set(names)) != len(names):
        raise UserError(f"--teachers {opts.teachers}: two teachers share a name ({names})")
    for name in names:
        if not TEACHER_NAME_RE.match(name):
            raise UserError(f"teacher name {name!r} is not file-safe (lowercase letters, digits, '-', '_')")
    return teachers


def validate_options(opts: BuildOptions) -> None:
    from cxrdr.common.shards import EMB_DTYPES

    checks = [
        (opts.n_aug >= 1, f"--n-aug must be >= 1 (got {opts.n_aug})"),
        (opts.n_captions >= 1, f"--n-captions must be >= 1 (got {opts.n_captions})"),
        (opts.store_size >= 16, f"--store-size must be >= 16 (got {opts.store_size})"),
        (opts.image_format in ("jpg", "png"), f"--image-format must be jpg or png (got {opts.image_format!r})"),
        (1 <= opts.jpeg_quality <= 100, f"--jpeg-quality must be in 1..100 (got {opts.jpeg_quality})"),
        (opts.emb_dtype in EMB_DTYPES, f"--emb-dtype must be one of {', '.join(EMB_DTYPES)} "
                                       f"(got {opts.emb_dtype!r})"),
        (opts.shard_size >= 1, f"--shard-size must be >= 1 (got {opts.shard_size})"),
        (opts.workers >= 0, f"--workers must be >= 0 (got {opts.workers})"),
        (opts.batch_size >= 1, f"--batch-size must be >= 1 (got {opts.batch_size})"),
        (opts.limit is None or opts.limit >= 1, f"--limit must be >= 1 (got {opts.limit})"),
        (opts.device == "auto" or opts.device == "cpu" or opts.device.startswith("cuda"),
         f"--device must be auto, cpu or cuda[:N] (got {opts.device!r})"),
        (opts.engine in ("local", "ray"), f"--engine must be local or ray (got {opts.engine!r})"),
        (opts.ray_actors is None or opts.ray_actors >= 1, f"--ray-actors must be >= 1 (got {opts.ray_actors})"),
        (opts.ray_retries >= 0, f"--ray-retries must be >= 0 (got {opts.ray_retries})"),
        (opts.engine != "ray" or (opts.world_size or 1) == 1,
         "--engine ray schedules the shards itself: drop --rank/--world-size (they are for torchrun)"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    if opts.engine == "ray":
        from cxrdr.reinforce.ray_engine import import_ray

        import_ray()  # fail before any work when Ray is missing


def build(opts: BuildOptions, fail_after_shards: int | None = None, teachers: list | None = None) -> dict:
    """Run one rank of a build; rank 0 also merges. Returns dataset.json (rank 0) or the rank's stats.

    ``teachers``: already loaded teachers (tests reuse them across builds); default: load
    ``opts.teachers``. ``fail_after_shards``: test hook mimicking a kill after N completed shards.
    """
    from cxrdr.reinforce import manifest
    from cxrdr.common.augment import AugConfig
    from cxrdr.reinforce.records import SkipLog
    from cxrdr.common.shards import SCHEMA_VERSION
    from cxrdr.reinforce.writer import is_shard_complete, write_json_atomic

    started = time.perf_counter()
    validate_options(opts)
    aug = opts.aug or AugConfig()
    rank, world = resolve_rank(opts.rank, opts.world_size)
    out_dir = Path(opts.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} exists and is not a folder")
    # ray: the driver loads the teachers only to describe them; actors pick their own device.
    device = "cpu" if opts.engine == "ray" else resolve_device(opts.device)

    source = _open_source(opts)
    records = list(itertools.islice(iter(source), opts.limit))
    images = bool(getattr(source, "requires_images", True))
    shards = cut_shards(assign_keys(records), opts.shard_size)
    if not shards:
        raise UserError(f"--source {opts.source} yielded no usable records "
                        f"({getattr(source, 'skipped', SkipLog()).summary()})")
    teachers = teachers if teachers is not None else _load_teachers(opts, device)

    plan = {
        "schema_version": SCHEMA_VERSION,
        "source": _json_safe(source.describe()),
        "images": images,
        "teachers": [_json_safe(t.describe()) for t in teachers],
        "aug": aug.to_json() if images else None,
        "captions": {"n": opts.n_captions, "seed": opts.seed, "generator": "cxrdr.reinforce.captions.make_captions"},
        "n_aug": opts.n_aug if images else 0,
        "n_captions": opts.n_captions,
        "store_size": opts.store_size if images else None,
        "image_format": opts.image_format if images else None,
        "jpeg_quality": opts.jpeg_quality if images and opts.image_format == "jpg" else None,
        "emb_dtype": opts.emb_dtype,
        "seed": opts.seed,
        "shard_size": opts.shard_size,
        "limit": opts.limit,
        "records": len(records),
        "shards": [s.describe() for s in shards],
        "source_skipped": getattr(source, "skipped", SkipLog()).to_json(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_build_rank(out_dir, rank, world)
    try:
        if lock.alone:  # no other rank or writer is running: temp files of a killed run are stale
            remove_stale_temp_files(out_dir)
        with plan_lock(out_dir):
            manifest.write_plan(out_dir, plan, opts.resume)
        return _build_rank(opts, out_dir, shards, teachers, images, aug, device, rank, world, started,
                           fail_after_shards)
    finally:
        lock.release()


def _build_rank(opts: BuildOptions, out_dir: Path, shards: list, teachers, images: bool, aug, device: str,
                rank: int, world: int, started: float, fail_after_shards: int | None) -> dict:
    """The part of ``build`` that writes, run while holding this rank's lock on ``out_dir``."""
    from cxrdr.reinforce import manifest
    from cxrdr.reinforce.records import SkipLog
    from cxrdr.reinforce.writer import is_shard_complete, write_json_atomic

    mine = [s for s in shards if s.index % world == rank]
    complete = [s for s in mine if is_shard_complete(out_dir, s.index)]
    if complete and not opts.resume:
        raise UserError(f"{out_dir} already holds {len(complete)} completed shard(s) of this build "
                        f"(e.g. {complete[0].name}); pass --resume to continue it or use another --out")
    todo = [s for s in mine if not is_shard_complete(out_dir, s.index)]
    spec = PrepareSpec(images=images, store_size=opts.store_size, image_format=opts.image_format,
                       jpeg_quality=opts.jpeg_quality, n_aug=opts.n_aug, n_captions=opts.n_captions,
                       aug=aug, seed=opts.seed,
                       sizes=tuple(sorted({t.image_size for t in teachers if t.has_images})) if images else ())
    skiplog = SkipLog()
    if opts.progress:
        typer.echo(f"rank {rank}/{world}: {len(mine)} of {len(shards)} shards are mine, "
                   f"{len(mine) - len(todo)} already complete; {sum(len(s.items) for s in todo)} records "
                   f"to build on {device} with {[t.name for t in teachers]}", err=True)
    if opts.engine == "ray":
        from cxrdr.reinforce.ray_engine import run_shards_ray

        result = run_shards_ray(todo, teachers, spec, opts, out_dir, skiplog)
    else:
        result = _run_shards(todo, teachers, spec, opts, out_dir, skiplog, fail_after_shards, rank)
    wall = time.perf_counter() - started
    rank_info = {"rank": rank, "world_size": world, "device": device, "workers": opts.workers,
                 "batch_size": opts.batch_size, "wall_seconds": round(wall, 3),
                 "shards_built": len(todo), "shards_skipped_as_complete": len(mine) - len(todo),
                 **result, "skipped": skiplog.to_json()}
    if todo or not manifest.rank_path(out_dir, rank).is_file():
        # A resume with nothing left to do keeps the timing of the run that did the work.
        write_json_atomic(manifest.rank_path(out_dir, rank), rank_info)
    if rank != 0:
        return rank_info
    dataset = manifest.merge(out_dir, wait_timeout=opts.merge_timeout if world > 1 else 0.0)
    return dataset


def summary_text(dataset: dict) -> str:
    b = dataset.get("build") or {}
    split = b.get("time_split_seconds", {})
    lines = [f"{dataset['total_samples']} samples in {len(dataset['shards'])} shards {dataset['counts']}",
             f"throughput {b.get('samples_per_second')} samples/s over {b.get('pipeline_seconds')} s "
             f"({b.get('wall_seconds')} s with setup); time split (s): "
             + ", ".join(f"{k} {v}" for k, v in split.items()),
             "bytes/sample: " + ", ".join(f"{k} {v:.0f}" for k, v in dataset["bytes_per_sample"].items())]
    if dataset.get("int8_max_abs_error"):
        lines.append(f"int8 max abs error: {dataset['int8_max_abs_error']}; "
                     f"min cosine to float32: {dataset.get('int8_min_cosine')}")
    src = dataset["skipped"]["source"]
    bld = dataset["skipped"]["build"]
    lines.append(f"skipped by source: {src.get('count', 0)} {src.get('by_reason', {})}; "
                 f"skipped by build: {bld['count']} {bld['by_reason']}")
    lines += [f"  {e['id']}: {e['reason']}" for e in (src.get("records", []) + bld["records"])[:20]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _pair(text: str, flag: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} expects MIN,MAX (e.g. 0.6,1.0), got {text!r}") from None
    if not 0 < lo <= hi:
        raise UserError(f"{flag} expects 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def cli_build(
    source: Annotated[str, typer.Option(help="Source spec: phantom[:N], mimic:PATH.jsonl, iu-xray:DIR, "
                                             "jsonl:PATH, csv:PATH.")] = "phantom",
    teachers: Annotated[str, typer.Option(help="Comma-separated teacher specs, e.g. "
                                               "biomedclip,text:minilm (random:tiny is for tests).")] = "biomedclip",
    out: Annotated[Path, typer.Option(help="Output shard folder.")] = DEFAULT_OUT,
    n_aug: Annotated[int, typer.Option(help="K augmentation parameter sets per image.")] = 10,
    n_captions: Annotated[int, typer.Option(help="S synthetic captions per sample.")] = 5,
    store_size: Annotated[int, typer.Option(help="Short side of the stored image in pixels.")] = 256,
    image_format: Annotated[str, typer.Option(help="Stored image format: jpg or png.")] = "jpg",
    jpeg_quality: Annotated[int, typer.Option(help="JPEG quality of stored images.")] = 95,
    emb_dtype: Annotated[str, typer.Option(help="Embedding storage: float16, int8 (per-row scale) "
                                                "or float32.")] = "float16",
    shard_size: Annotated[int, typer.Option(help="Samples (records) per shard.")] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of augmentation and caption sampling.")] = 0,
    workers: Annotated[int, typer.Option(help="DataLoader workers decoding and augmenting.")] = 2,
    batch_size: Annotated[int, typer.Option(help="Records per teacher batch (K*B crops per image "
                                                 "forward).")] = 32,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N] for the teachers.")] = "auto",
    model_cache: Annotated[Optional[str], typer.Option(help="Folder with local teacher weights.")] = None,
    resume: Annotated[bool, typer.Option(help="Skip shards already complete in --out.")] = False,
    rank: Annotated[Optional[int], typer.Option(help="This process's rank (default: $RANK or 0).")] = None,
    world_size: Annotated[Optional[int], typer.Option(help="Number of ranks (default: $WORLD_SIZE or 1); "
                                                           "shard i is built by rank i % world.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N records of the source.")] = None,
    merge_timeout: Annotated[float, typer.Option(help="Seconds rank 0 waits for other ranks before "
                                                      "merging.")] = 3600.0,
    crop_scale: Annotated[Optional[str], typer.Option(help="RandomResizedCrop area fraction MIN,MAX "
                                                           "[default: 0.6,1.0].")] = None,
    crop_ratio: Annotated[Optional[str], typer.Option(help="RandomResizedCrop aspect ratio w/h MIN,MAX "
                                                           "[default: 3/4,4/3].")] = None,
    max_angle: Annotated[Optional[float], typer.Option(help="Max rotation in degrees [default: 7].")] = None,
    randaugment: Annotated[Optional[int], typer.Option(help="RandAugment-style photometric ops per set "
                                                            "[default: 0 = off].")] = None,
    randaugment_magnitude: Annotated[Optional[float], typer.Option(help="RandAugment magnitude 0..10 "
                                                                        "[default: 5].")] = None,
    image_root: Annotated[Optional[str], typer.Option(help="Source: folder image paths are relative to.")] = None,
    col_id: Annotated[Optional[str], typer.Option(help="Source column: record id.")] = None,
    col_image: Annotated[Optional[str], typer.Option(help="Source column: image path.")] = None,
    col_report: Annotated[Optional[str], typer.Option(help="Source column: report text.")] = None,
    col_findings: Annotated[Optional[str], typer.Option(help="Source column: findings.")] = None,
    col_impression: Annotated[Optional[str], typer.Option(help="Source column: impression.")] = None,
    col_labels: Annotated[Optional[str], typer.Option(help="Source column: labels.")] = None,
    col_split: Annotated[Optional[str], typer.Option(help="Source column: split.")] = None,
    col_subject: Annotated[Optional[str], typer.Option(help="Source column: subject id.")] = None,
    col_study: Annotated[Optional[str], typer.Option(help="Source column: study id.")] = None,
    col_view: Annotated[Optional[str], typer.Option(help="Source column: view position.")] = None,
    labels_format: Annotated[Optional[str], typer.Option(help="Source: how the labels column is "
                                                              "encoded.")] = None,
    scene_graphs: Annotated[Optional[str], typer.Option(help="Source (mimic): Chest ImaGenome scene "
                                                             "graphs.")] = None,
    frontal_only: Annotated[Optional[bool], typer.Option("--frontal-only/--all-views",
                                                         help="Source: keep frontal views only.")] = None,
    min_report_chars: Annotated[Optional[int], typer.Option(help="Source: shortest usable report.")] = None,
    phantom_size: Annotated[Optional[int], typer.Option(help="Source (phantom): rendered image size.")] = None,
    source_seed: Annotated[Optional[int], typer.Option(help="Source (phantom): generator seed.")] = None,
    engine: Annotated[str, typer.Option(help="local: this process (or torchrun ranks); ray: shards on a Ray "
                                             "actor pool ($RAY_ADDRESS, else a local Ray).")] = "local",
    ray_actors: Annotated[Optional[int], typer.Option(help="--engine ray: actors, each with its own teachers "
                                                           "(default: one per GPU, else CPUs / workers).")] = None,
    ray_retries: Annotated[int, typer.Option(help="--engine ray: retries of a shard whose actor died or "
                                                  "that raised.")] = 3,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Build reinforced WebDataset shards: stored images, captions, aug params, teacher embeddings."""
    from cxrdr.common.augment import AugConfig

    # Only flags given override AugConfig's defaults (so a CLI build equals a default-config build).
    given = {"scale": _pair(crop_scale, "--crop-scale") if crop_scale else None,
             "ratio": _pair(crop_ratio, "--crop-ratio") if crop_ratio else None,
             "max_angle": max_angle, "randaugment_n": randaugment,
             "randaugment_magnitude": randaugment_magnitude}
    aug = AugConfig(**{k: v for k, v in given.items() if v is not None})
    if aug.max_angle < 0 or aug.randaugment_n < 0 or not 0 <= aug.randaugment_magnitude <= 10:
        raise UserError("--max-angle and --randaugment must be >= 0 and --randaugment-magnitude in 0..10")
    source_options = dict(image_root=image_root, col_id=col_id, col_image=col_image, col_report=col_report,
                          col_findings=col_findings, col_impression=col_impression, col_labels=col_labels,
                          col_split=col_split, col_subject=col_subject, col_study=col_study,
                          col_view=col_view, labels_format=labels_format, scene_graphs=scene_graphs,
                          frontal_only=frontal_only, min_report_chars=min_report_chars,
                          size=phantom_size, seed=source_seed)
    opts = BuildOptions(source=source, teachers=teachers, out=out, n_aug=n_aug, n_captions=n_captions,
                        store_size=store_size, image_format=image_format.lower().replace("jpeg", "jpg"),
                        jpeg_quality=jpeg_quality, emb_dtype=emb_dtype, shard_size=shard_size, seed=seed,
                        workers=workers, batch_size=batch_size, device=device, model_cache=model_cache,
                        resume=resume, rank=rank, world_size=world_size, limit=limit, aug=aug,
                        source_options=source_options, merge_timeout=merge_timeout, progress=not quiet,
                        engine=engine, ray_actors=ray_actors, ray_retries=ray_retries)
    result = build(opts)
    if "total_samples" in result:
        typer.echo(summary_text(result))
        typer.echo(f"wrote {out}")
    else:
        typer.echo(f"rank {result['rank']}: built {result['samples_built']} samples in "
                   f"{result['shards_built']} shards; rank 0 merges")
