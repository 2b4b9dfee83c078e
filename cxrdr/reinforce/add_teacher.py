"""`reinforce add-teacher DIR --teachers SPEC`: add a teacher's embeddings to existing shards.

For each shard: read every sample, decode its stored image (the same PIL decode stage 2 uses),
replay its stored aug params at the new teacher's input size, re-embed its stored report and
captions, and rewrite the shard (temp name + rename) with the original members' bytes
unchanged plus one new ``<teacher>.npy`` member per teacher. Images, captions, params and
the other teachers' embeddings are never recomputed. An older folder is upgraded on the way to the
current schema, so a folder never mixes layouts: schema-1 per-part members are repacked losslessly
into one member per teacher (same stored values), and a schema-1 or 2 json member is rewritten in the
schema-3 form (``encode_meta``: same meaning, one type per field).

Loader workers (``--workers``; by default on CUDA) read and prepare whole shards, decoding and replaying there;
this process embeds (a batch's forwards queued before the one before it is waited for) and a thread of it writes
(``ordered_tasks``), each shard's samples in their order, so the bytes do not depend on the workers.

Resumable: a shard whose stats already list the teacher is skipped; a shard interrupted
between its rename and its stats update is redone (existing members of the teacher are
replaced, not duplicated). dataset.json is re-merged at the end.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import typer
from tqdm import tqdm

from cxrdr.common.atomic import write_json_atomic
from cxrdr.common.checksums import checksum_record, member_checksums
from cxrdr.common.errors import UserError
from cxrdr.common.heap import frozen_heap
from cxrdr.common.host_threads import host_threads, threads_beside
from cxrdr.common.locking import lock_folder, remove_stale_temp_files
from cxrdr.common.phase_clock import PhaseClock
from cxrdr.common.shards import (SCHEMA_VERSION, encode_meta, encode_teacher, iter_tar_samples, load_meta,
                                 merge_int8_quality, meta_member, part_of, read_dataset_info, repack_v1_teacher,
                                 shard_compression, shard_index, teacher_ext)
from cxrdr.reinforce import manifest
from cxrdr.reinforce.embed import QueuedBatch, queue_batch, worker_tokenizers
from cxrdr.reinforce.ordered_tasks import OrderedTasks
from cxrdr.reinforce.options import BuildOptions, load_build_teachers, resolve_device, resolve_replay, resolve_workers
from cxrdr.reinforce.prepare import (collate_prepared, decode_stored_image, json_safe, replay_on_device,
                                     views_or_pixels)
from cxrdr.reinforce.writer import TMP_SUFFIX, TarOut, read_shard_stats, stats_path


class ShardBatches(torch.utils.data.IterableDataset):
    """The shards to rewrite, read in ``--workers`` loader workers (or here with none): each worker takes whole
    shards and hands on, shard by shard, batches of (key, sample members, metadata, prepared entry) in the shard's
    order, the last batch of a shard marked. Reading the tar, decoding the image and replaying its views on the CPU
    are most of add-teacher's work (on an H200 it rewrote 20,000 samples in 63 s on one process, ~3 ms of host time a
    sample, with the teacher's forwards a small part): the workers take that, this process embeds and a thread of it
    writes."""

    def __init__(self, shards_dir: Path, shards: list[dict], info: dict, sizes: list[int], replay: str,
                 batch_size: int, tokenizers: tuple = ()):
        self.shards_dir, self.shards, self.info = shards_dir, shards, info
        self.sizes, self.replay, self.batch_size = sizes, replay, batch_size
        # (teacher name, its text_tokenizer()): the texts tokenized where they are read, as the build's workers do
        # (open_clip's BPE tokenizer took 13 % of this process beside the tiny teacher on the 2-core box, whose
        # cores the workers already fill: no faster there; on a GPU host the workers have cores to spare)
        self.tokenizers = tokenizers

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        mine = self.shards if worker is None else self.shards[worker.id::worker.num_workers]
        for shard in mine:
            pending: list[tuple] = []
            for key, sample in iter_tar_samples(self.shards_dir / shard["name"]):
                meta = load_meta(sample["json"])  # parsed once, here: the writer reuses it
                pending.append((key, sample, meta, self.prepare(key, sample, meta)))
                if len(pending) >= self.batch_size:
                    yield self.batch(shard["name"], pending, last=False)
                    pending = []
            yield self.batch(shard["name"], pending, last=True)

    @staticmethod
    def batch(shard: str, items: list[tuple], last: bool) -> dict:
        """A batch as it leaves the worker: its samples' stored pixels (device replay) or views (CPU replay) packed
        into one tensor (a tensor per teacher size) by the build's own collate. A tensor crosses from a loader worker
        as a file descriptor of its own, ~0.7 ms of this process apiece on the 2-core box: one a sample cost the
        process about as much as writing the sample."""
        packed = collate_prepared([entry for *_, entry in items])  # takes them out of the entries
        return {"shard": shard, "items": items, "last": last, "crops": packed["crops"], "pixels": packed.get("pixels")}

    def prepare(self, key: str, sample: dict, meta: dict) -> dict:
        """What the teachers take of one sample: its texts and, with image teachers, its views (or pixels)."""
        texts = [sample["txt"].decode("utf-8")] + [c["text"] for c in meta["captions"]]
        entry = {"key": key, "texts": texts, "crops": {}, "aug": meta["aug"], "image_size": None}
        if self.tokenizers:
            entry["tokens"] = {name: np.asarray(tokenize(texts)) for name, tokenize in self.tokenizers}
        if self.sizes:
            pixels = np.asarray(decode_stored_image(sample[self.info["image_format"]]))
            entry.update(views_or_pixels(pixels, meta["aug"], self.sizes, self.replay), image_size=pixels.shape[::-1])
        return entry


def _as_is(batch):
    """The loader's collate: a ShardBatches batch goes through as it is."""
    return batch


def teacher_sizes(teachers, info: dict) -> list[int]:
    """The image sizes the teachers' views are replayed at (none for text teachers or image-less shards)."""
    return sorted({t.image_size for t in teachers if t.has_images}) if info.get("images", True) else []


def queue_prepared(prepared: list[dict], teachers, info: dict, replay: str = "cpu", device: str = "cpu",
                   crops: dict | None = None, pixels: torch.Tensor | None = None) -> QueuedBatch:
    """Every teacher's forwards of these prepared samples (``ShardBatches.prepare``), queued (``result()`` waits for
    their rows), whose views or pixels the batch packed (``ShardBatches.batch``): ``crops`` ({size: (B*K, 1, S, S)},
    ``replay`` cpu: replayed where they were prepared) or ``pixels`` ((B, 1, H, W) uint8, ``replay`` device: the
    whole batch's views are replayed at once on ``device`` here), as the build's ``options.resolve_replay``."""
    images, sizes = info.get("images", True), teacher_sizes(teachers, info)
    if replay == "device" and sizes:
        return queue_batch(teachers, prepared, images, crops=replay_on_device(pixels, prepared, sizes, device))
    return queue_batch(teachers, prepared, images, crops=crops if sizes else None)


class ShardRewrite:
    """One shard rewritten with the new teachers' members: a temporary file written batch by batch (``add``),
    renamed over the shard and its stats updated at the end (``finish``); ``abort`` leaves the shard as it was."""

    def __init__(self, shards_dir: Path, name: str, teachers, info: dict):
        self.shards_dir, self.info = shards_dir, info
        self.index = shard_index(name)
        self.path = shards_dir / name
        self.stats = read_shard_stats(shards_dir, self.index)
        self.new_names = {t.name for t in teachers}
        self.old_names = [t["name"] for t in info["teachers"] if t["name"] not in self.new_names]
        self.upgrade = info.get("schema_version", 1) < 2
        self.upgrade_json = info.get("schema_version", 1) < 3
        self.errors = self.stats.get("int8_max_abs_error") or {}
        self.cosines = self.stats.get("int8_min_cosine") or {}
        self.part_bytes: dict[str, int] = {}
        self.checksums: dict[str, dict[str, str]] = {}
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.file = open(self.tmp, "wb")
        self.tar = TarOut(self.file, shard_compression(name))  # the shard keeps its compression

    def add(self, items: list[tuple], embs: list[dict]) -> None:
        """Write one batch: each sample's members as they were plus its new teachers' rows (``embs``)."""
        for (key, sample, meta, _), emb in zip(items, embs):
            out = {"__key__": key}
            # Keep every original member byte-for-byte; drop stale members of the new teachers.
            out.update({ext: data for ext, data in sample.items() if part_of(ext) not in self.new_names})
            if self.upgrade:  # schema 1 -> 2: the old teachers' part members become one member each
                for name in self.old_names:
                    packed = repack_v1_teacher(sample, name)
                    if packed is not None:  # None: this shard was upgraded by an interrupted run
                        out = {ext: data for ext, data in out.items() if part_of(ext) != name}
                        out[teacher_ext(name)] = packed
            if self.upgrade_json:  # schema 1/2 -> 3: the same metadata in the stored types of schema 3
                out["json"] = meta_member(encode_meta(meta))
            for teacher, parts in emb.items():
                data, quality = encode_teacher(parts, self.info["emb_dtype"], len(meta["aug"]), len(meta["captions"]))
                merge_int8_quality(self.errors, self.cosines, teacher, quality)
                out[teacher_ext(teacher)] = data
            for ext, data in out.items():
                if not ext.startswith("__"):
                    self.part_bytes[part_of(ext)] = self.part_bytes.get(part_of(ext), 0) + len(data)
            self.tar.write(out)
            self.checksums[key] = member_checksums(out)

    def finish(self) -> dict:
        """Close, rename over the shard, update its stats; returns them."""
        self.tar.close()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        stats = self.stats
        stats["bytes"] = self.part_bytes
        stats["teachers"] = [n for n in stats.get("teachers", []) if n not in self.new_names] + sorted(self.new_names)
        stats["tar_bytes"] = self.tmp.stat().st_size
        stats["checksums"] = checksum_record(self.checksums)
        if self.info["emb_dtype"] == "int8":
            stats["int8_max_abs_error"], stats["int8_min_cosine"] = self.errors, self.cosines
        os.replace(self.tmp, self.path)
        write_json_atomic(stats_path(self.shards_dir, self.index), stats, indent=None)
        return stats

    def abort(self) -> None:
        """Close the temporary file, leave the shard untouched (the next run removes the temporary file)."""
        self.file.close()


def rewrite_shards(shards_dir: Path, shards: list[dict], teachers, info: dict, batch_size: int, replay: str = "cpu",
                   device: str = "cpu", workers: int = 0, progress: bool = False) -> tuple[int, dict]:
    """Add ``teachers`` to each of ``shards``, read and prepared by ``workers`` loader workers (0: here), embedded
    here and written on a thread of this process (``OrderedTasks``); a shard is replaced once all of it is written,
    so an interruption loses at most the shards in progress. The same bytes whatever ``workers`` is: each shard's
    samples keep their order. Returns the workers used (at most one a shard) and where the time went
    (``TIME_SPLIT``, seconds).

    As the build does (``pipeline._ShardLoop``), a batch's forwards are queued before the batch before it is
    waited for and handed to the writing thread: a GPU teacher goes from one batch to the next while this process
    waits for its loader and the thread writes. Until stop 67 reading, forwards and writing took turns here."""
    batches = ShardBatches(shards_dir, shards, info, teacher_sizes(teachers, info), replay, batch_size,
                           tokenizers=worker_tokenizers(teachers))
    workers = min(workers, len(shards))
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=workers, collate_fn=_as_is,
                                         prefetch_factor=2 if workers else None)
    open_shards: dict[str, ShardRewrite] = {}
    clock = PhaseClock()
    bar = tqdm(total=len(shards), unit="shard", desc="add-teacher", disable=not progress)
    writing = OrderedTasks(depth=WRITE_QUEUE_BATCHES, name="add-teacher-writer")
    pending = None  # (shard name, its items, their queued forwards, whether the shard ends with them)

    def complete(batch: tuple) -> None:
        """Wait for a batch's rows and hand it to the writing thread, and its shard's rename if it ends it."""
        name, items, queued, last = batch
        clock.skip()
        embs = queued.result() if queued is not None else None
        clock.lap("embed")
        if items:
            writing.submit(open_shards[name].add, items, embs)
        if last:
            writing.submit(_finish, open_shards[name], bar)
            del open_shards[name]  # once queued: a shard whose rename was never queued is aborted below

    failed = True
    try:
        # workers fork with this process's heap: a collection in one would touch, and copy, all of its pages; on a
        # GPU this process's threads keep to the cores they leave (cxrdr.common.host_threads: on the H200 14 workers
        # beside every core's thread took 60.7 s for the recipe's 20,000 samples, none 63.4 s)
        on_gpu = workers and str(device).startswith("cuda")
        with frozen_heap() if workers else contextlib.nullcontext(), \
                host_threads(threads_beside(workers) if on_gpu else None):
            clock.skip()
            for batch in loader:
                clock.lap("loader_wait")
                name = batch["shard"]
                if name not in open_shards:
                    open_shards[name] = ShardRewrite(shards_dir, name, teachers, info)
                items = batch["items"]  # empty where a shard ended on a full batch
                queued = queue_prepared([entry for *_, entry in items], teachers, info, replay, device,
                                        crops=batch["crops"], pixels=batch["pixels"]) if items else None
                clock.lap("embed")
                if pending is not None:  # taken out first: a batch whose completion failed is not completed again
                    previous, pending = pending, None
                    complete(previous)
                pending = (name, items, queued, batch["last"])  # only once every batch before it was handed on
                clock.skip()  # handing the batch on: the writing thread's wait, counted there
            clock.lap("loader_wait")  # the loader's end
            if pending is not None:
                last_batch, pending = pending, None
                complete(last_batch)
        writing.close()
        failed = False
    finally:
        # what was handed on is written (the shards it finishes are kept), then the batch in hand if every batch
        # before it was handed on; the rest is left as it was (a shard never renamed without one of its batches)
        if failed:
            with contextlib.suppress(Exception):
                if pending is not None:
                    complete(pending)
            with contextlib.suppress(Exception):
                writing.close()
            for rewrite in open_shards.values():
                rewrite.abort()
        bar.close()
    split = {**dict.fromkeys(TIME_SPLIT, 0.0), **clock.seconds,
             "write_wait": round(writing.wait_seconds, 3), "write": round(writing.busy_seconds, 3)}
    return workers, split


def _finish(rewrite: "ShardRewrite", bar) -> None:
    rewrite.finish()
    bar.update(1)


# Where add-teacher's time goes: this process waiting for its loader (the workers' reading, decoding and
# replaying), queuing the teachers' forwards and waiting for their rows (on CUDA, up to the copy back), and blocked
# on the writing thread (its queue full, and at the end); and that thread writing the shards (their members,
# checksums, deflate and rename), beside the rest. The build records its own split likewise (dataset.json).
TIME_SPLIT = ("loader_wait", "embed", "write_wait", "write")
WRITE_QUEUE_BATCHES = 4  # batches waiting to be written at most (memory stays flat)


def addition_summary(addition: dict) -> str:
    """One ``teacher_additions`` record in a line: its seconds and where they went."""
    split = ", ".join(f"{k} {v:.1f}" for k, v in addition["time_split_seconds"].items())
    return f"{addition['seconds']:.1f} s; time split (s): {split}"


def add_teacher_workers(workers: int | None, device: str) -> int:
    """--workers, or its default: on CUDA the build's (every core but two, at most 16: the teacher's forwards are a
    small part of the work), on the CPU none (the teacher's forwards take the cores)."""
    if workers is not None:
        return workers
    return resolve_workers(None, device) if str(device).startswith("cuda") else 0


def add_teachers(shards_dir: Path, specs: str, device: str = "auto", model_cache: str | None = None,
                 batch_size: int = 32, progress: bool = True, teachers: list | None = None,
                 replay: str = "auto", workers: int | None = None) -> dict:
    """Add the teachers in ``specs`` to every shard of ``shards_dir``; returns the new dataset.json.

    ``teachers``: already loaded teachers for ``specs`` (tests reuse them); default: load them.
    ``replay``: where the stored views are replayed, as ``reinforce build --replay`` (auto: on a CUDA
    device the whole batch's views at once there, else image by image on the CPU).
    ``workers``: loader workers reading and preparing whole shards (``add_teacher_workers``).
    """
    shards_dir = Path(shards_dir)
    info = read_dataset_info(shards_dir)  # before locking: a missing folder is not created
    with lock_folder(shards_dir, "reinforce add-teacher"):
        remove_stale_temp_files(shards_dir)
        return _add_teachers(shards_dir, info, specs, device, model_cache, batch_size, progress, teachers, replay,
                             workers)


def _add_teachers(shards_dir: Path, info: dict, specs: str, device: str, model_cache: str | None,
                  batch_size: int, progress: bool, teachers: list | None, replay: str = "auto",
                  workers: int | None = None) -> dict:
    """``add_teachers`` while holding the folder lock."""
    plan = manifest.read_plan(shards_dir)
    missing = manifest.missing_shards(shards_dir, plan)
    if missing:
        raise UserError(f"{shards_dir} has incomplete shards ({missing[:5]}); finish the build first")
    device = resolve_device(device)
    if teachers is None:
        teachers = load_build_teachers(BuildOptions(teachers=specs, model_cache=model_cache), device)
    replay = resolve_replay(replay, device)
    existing = {t["name"] for t in plan["teachers"]}
    clash = sorted({t.name for t in teachers} & existing)
    if clash:
        raise UserError(f"{shards_dir} already has teacher(s) {clash}; add a differently named one "
                        f"(spec option ?name=NEW) or rebuild")
    started = time.perf_counter()
    names = {t.name for t in teachers}
    todo = [s for s in info["shards"]
            if not names <= set(read_shard_stats(shards_dir, shard_index(s["name"])).get("teachers", []))]
    workers, split = rewrite_shards(shards_dir, todo, teachers, info, batch_size, replay, device,
                                    workers=add_teacher_workers(workers, device), progress=progress)
    plan["teachers"] = plan["teachers"] + [json_safe(t.describe()) for t in teachers]
    if plan.get("schema_version", 1) < SCHEMA_VERSION:  # rewrite_shard upgraded every shard
        plan.setdefault("upgraded_from_schema_version", plan.get("schema_version", 1))
        plan["schema_version"] = SCHEMA_VERSION
    plan.setdefault("teacher_additions", []).append(
        {"teachers": [t.name for t in teachers], "spec": specs, "shards_rewritten": len(todo), "replay": replay,
         "workers": workers, "seconds": round(time.perf_counter() - started, 3), "time_split_seconds": split})
    write_json_atomic(manifest.plan_path(shards_dir), plan)
    return manifest.merge(shards_dir)


def cli_add_teacher(
    shards_dir: Annotated[Path, typer.Argument(help="Shard folder written by `reinforce build`.")],
    teachers: Annotated[str, typer.Option(help="Comma-separated teacher specs to add.")],
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
    model_cache: Annotated[str | None, typer.Option(help="Folder with local teacher weights.")] = None,
    batch_size: Annotated[int, typer.Option(help="Samples per teacher batch.")] = 32,
    replay: Annotated[str, typer.Option(help="Where the stored views are replayed: auto (device on CUDA), cpu "
                                             "(image by image), device (each batch's views at once there).")] = "auto",
    workers: Annotated[int | None, typer.Option(help="Loader workers reading and preparing whole shards (default: "
                                                     "on CUDA every core but two, at most 16; on the CPU 0).")] = None,
) -> None:
    """Add teacher embeddings to existing shards by replaying their stored aug params and captions."""
    if not shards_dir.is_dir():
        raise UserError(f"shard folder not found: {shards_dir}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1 (got {batch_size})")
    if replay not in ("auto", "cpu", "device"):
        raise UserError(f"--replay must be auto, cpu or device (got {replay!r})")
    if workers is not None and workers < 0:
        raise UserError(f"--workers must be >= 0 (got {workers})")
    dataset = add_teachers(shards_dir, teachers, device=device, model_cache=model_cache, batch_size=batch_size,
                           replay=replay, workers=workers)
    typer.echo(f"{shards_dir}: teachers now {[t['name'] for t in dataset['teachers']]}; "
               f"bytes/sample {dataset['bytes_per_sample']}; {addition_summary(dataset['teacher_additions'][-1])}")
