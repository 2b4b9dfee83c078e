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
   over chunks of about B/(2*workers) records with their crops in one tensor per size. With
   ``--replay device`` (the default with a CUDA teacher) they replay nothing and hand over the
   stored pixels instead (uint8, one zero-padded tensor per chunk).
3. The main process regroups the chunks into batches of B = ``--batch-size`` records (``--replay
   device``: replays the batch's views at once on the teachers' device, ``replay_batch``) and runs
   the teacher forwards (K*B crops per image forward; reports + captions per text forward).
4. A background thread writes the tar (bounded queue), as ``shard-NNNNNN.tar.tmp`` renamed
   with its ``stats/shard-NNNNNN.json`` when complete.
5. Rank 0 waits for every shard of the plan, then merges manifest.parquet, sizes.json and
   dataset.json (``cxrdr.reinforce.manifest.merge``).

Shard ``i`` belongs to rank ``i % world_size`` (from ``--rank/--world-size`` or torchrun's
RANK/WORLD_SIZE). ``--engine ray`` instead builds the pending shards of steps 2-4 on a Ray
actor pool with the same ``pipeline.run_shards`` (reinforce.ray_engine); same plan, same bytes.
The format is ``cxrdr.common.shards`` (prose: shards/FORMAT.md).

Modules: ``options`` (flags, validation, source/teachers/rank/device), ``plan`` (shard cut),
``prepare`` (step 2), ``embed`` (step 3), ``assemble`` + ``writer`` (step 4), ``pipeline`` (the
loop over steps 2-4), ``cpu_policy`` (where a CPU teacher's build prepares), ``manifest`` (step 5),
``summary`` (what the CLI prints), ``build_cli``.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import typer

from cxrdr.common.atomic import write_json_atomic
from cxrdr.common.augment import AugConfig
from cxrdr.common.errors import UserError
from cxrdr.common.locking import lock_build_rank, plan_lock
from cxrdr.common.shards import SCHEMA_VERSION, assign_keys
from cxrdr.reinforce import manifest
from cxrdr.reinforce.captioners import load_captioner
from cxrdr.reinforce.embed import worker_tokenizers
from cxrdr.reinforce.options import (BuildOptions, load_build_teachers, open_source_of, resolve_device,
                                     resolve_rank, resolve_workers, validate_options)
from cxrdr.reinforce.pipeline import run_shards
from cxrdr.reinforce.plan import cut_shards
from cxrdr.reinforce.prepare import PrepareSpec, json_safe
from cxrdr.reinforce.ray_engine import import_ray, run_shards_ray
from cxrdr.reinforce.records import SkipLog
from cxrdr.reinforce.writer import is_shard_complete

__all__ = ["BuildOptions", "build"]


def build(opts: BuildOptions, fail_after_shards: int | None = None, teachers: list | None = None) -> dict:
    """Run one rank of a build; rank 0 also merges. Returns dataset.json (rank 0) or the rank's stats.

    ``teachers``: already loaded teachers (tests reuse them across builds); default: load
    ``opts.teachers``. ``fail_after_shards``: test hook mimicking a kill after N completed shards.
    """
    started = time.perf_counter()
    validate_options(opts)
    if opts.engine == "ray":
        import_ray()  # fail before any work when Ray is missing
    aug = opts.aug or AugConfig()
    rank, world = resolve_rank(opts.rank, opts.world_size)
    out_dir = Path(opts.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} exists and is not a folder")
    # ray: the driver loads the teachers only to describe them; actors pick their own device.
    device = "cpu" if opts.engine == "ray" else resolve_device(opts.device)
    # ray: each actor's DataLoader; its device is the actor's, so the default is the CPU one
    opts = dataclasses.replace(opts, workers=resolve_workers(opts.workers, device))

    source = open_source_of(opts)
    if opts.captioner:  # the captioner gives an image without report text its text: keep such records
        source.allow_image_only = True
    records = list(itertools.islice(iter(source), opts.limit))
    images = bool(getattr(source, "requires_images", True))
    if opts.captioner and not images:
        raise UserError(f"--captioner {opts.captioner} captions images: --source {opts.source} has none")
    shards = cut_shards(assign_keys(records), opts.shard_size, opts.compression)
    if not shards:
        raise UserError(f"--source {opts.source} yielded no usable records "
                        f"({getattr(source, 'skipped', SkipLog()).summary()})")
    teachers = teachers if teachers is not None else load_build_teachers(opts, device)
    captioner = load_captioner(opts.captioner, teachers, records) if opts.captioner else None

    plan = _plan(opts, source, images, teachers, aug, records, shards, captioner)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_build_rank(out_dir, rank, world)  # the first rank removes a killed run's temp files
    try:
        with plan_lock(out_dir):
            manifest.write_plan(out_dir, plan, opts.resume)
        if captioner is not None:  # every rank writes the same bank (each file renamed into place)
            captioner.write(out_dir)
        return _build_rank(opts, out_dir, shards, teachers, images, aug, device, rank, world, started,
                           fail_after_shards, captioner)
    finally:
        lock.release()


def _build_rank(opts: BuildOptions, out_dir: Path, shards: list, teachers, images: bool, aug, device: str,
                rank: int, world: int, started: float, fail_after_shards: int | None, captioner=None) -> dict:
    """The part of ``build`` that writes, run while holding this rank's lock on ``out_dir``."""
    mine = [s for s in shards if s.index % world == rank]
    complete = [s for s in mine if is_shard_complete(out_dir, s.index)]
    if complete and not opts.resume:
        raise UserError(f"{out_dir} already holds {len(complete)} completed shard(s) of this build "
                        f"(e.g. {complete[0].name}); pass --resume to continue it or use another --out")
    todo = [s for s in mine if not is_shard_complete(out_dir, s.index)]
    spec = PrepareSpec(images=images, store_size=opts.store_size, image_format=opts.image_format,
                       jpeg_quality=opts.jpeg_quality, n_aug=opts.n_aug, n_captions=opts.n_captions,
                       aug=aug, seed=opts.seed, captioner=captioner is not None,
                       tokenizers=worker_tokenizers(teachers) if captioner is None else (),
                       sizes=tuple(sorted({t.image_size for t in teachers if t.has_images})) if images else ())
    skiplog = SkipLog()
    if opts.progress:
        typer.echo(f"rank {rank}/{world}: {len(mine)} of {len(shards)} shards are mine, "
                   f"{len(mine) - len(todo)} already complete; {sum(len(s.items) for s in todo)} records "
                   f"to build on {device} with {[t.name for t in teachers]}", err=True)
    if opts.engine == "ray":
        result = run_shards_ray(todo, teachers, spec, opts, out_dir, skiplog)
    else:
        result = run_shards(todo, teachers, spec, opts, out_dir, skiplog, fail_after_shards, rank, captioner=captioner)
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


def _plan(opts: BuildOptions, source, images: bool, teachers, aug, records: list, shards: list,
          captioner=None) -> dict:
    """``stats/plan.json``: the settings and the shard boundaries every rank agrees on. A captioner adds
    ``captioner`` (its describe(): spec, teacher, bank) and names itself the captions' generator; a build
    without one writes exactly the plan it wrote before the option."""
    plan = {
        "schema_version": SCHEMA_VERSION,
        "source": json_safe(source.describe()),
        "images": images,
        "teachers": [json_safe(t.describe()) for t in teachers],
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
        "compression": opts.compression,
        "limit": opts.limit,
        "records": len(records),
        "shards": [s.describe() for s in shards],
        "source_skipped": getattr(source, "skipped", SkipLog()).to_json(),
    }
    if captioner is not None:
        plan["captions"] = {"n": opts.n_captions, "per": "view", "seed": opts.seed,
                            "generator": f"cxrdr.reinforce.captioners ({captioner.name})",
                            "caption_source": captioner.caption_source}
        plan = {**{k: v for k, v in plan.items() if k not in ("shards", "source_skipped")},
                "captioner": json_safe(captioner.describe()),
                "shards": plan["shards"], "source_skipped": plan["source_skipped"]}
    return plan
