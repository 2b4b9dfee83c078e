"""The shard loop of one rank (or one Ray actor): prepare (DataLoader workers) -> embed (this
process) -> write (a background thread), for the pending shards of the plan.

Workers hand over chunks of about B/(2*workers) records with their crops in one tensor per
teacher size; this process regroups them into batches of B = ``--batch-size`` records for the
teacher forwards, assembles the samples and queues them to the writer, which renames each
shard's tar with its stats file when complete. A CPU teacher's intra-op threads are chosen from
the first batches' CPU figures (``teacher_threads``, ``_ThreadPolicy``) and printed.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cxrdr.common.shards import shard_name
from cxrdr.reinforce.assemble import assemble_sample
from cxrdr.reinforce.embed import embed_batch
from cxrdr.reinforce.options import BuildOptions
from cxrdr.reinforce.plan import ShardPlan
from cxrdr.reinforce.prepare import PrepareDataset, PrepareSpec, collate_prepared
from cxrdr.reinforce.writer import BackgroundWriter

TIMING_KEYS = ("decode_augment", "teacher", "write", "loader_wait")


class SimulatedKill(RuntimeError):
    """Raised by the test hook ``fail_after_shards`` to mimic a build killed partway."""


def run_shards(todo: list[ShardPlan], teachers, spec: PrepareSpec, opts: BuildOptions, out_dir: Path,
               skiplog, fail_after_shards: int | None, rank: int, announce: bool = True) -> dict:
    """Build the shards ``todo``; returns the rank's timing and counts. ``announce``: print the
    CPU thread choice (with ``opts.progress``)."""
    items = [(s.index, key, rec) for s in todo for key, rec in s.items]
    if not items:
        return {"samples_built": 0, "pipeline_seconds": 0.0, "time_split_seconds": dict.fromkeys(TIMING_KEYS, 0.0)}
    started = time.perf_counter()
    # Workers prepare chunks smaller than a teacher batch, so all of them work on the first batch
    # (a whole batch per worker would leave the teacher idle for a full batch's preparation at
    # the start). The main process regroups the chunks into the same --batch-size batches.
    chunk = _chunk_size(opts.batch_size, opts.workers)
    loader = torch.utils.data.DataLoader(
        PrepareDataset(items, spec), batch_size=chunk, shuffle=False,
        num_workers=opts.workers, collate_fn=collate_prepared,
        prefetch_factor=max(2, -(-opts.batch_size // chunk)) if opts.workers > 0 else None,
        persistent_workers=False)
    loop = _ShardLoop(todo, teachers, spec, opts, out_dir, skiplog, fail_after_shards)
    bar = tqdm(total=len(items), unit="rec", desc=f"build[{rank}]", disable=not opts.progress)
    policy = _ThreadPolicy(teachers, opts.workers, say=bar.write if announce and opts.progress else None)
    try:
        with _cpu_settings(policy, opts.workers):
            t_wait = time.perf_counter()
            for collated in _regroup(loader, opts.batch_size):
                loop.timing["loader_wait"] += time.perf_counter() - t_wait
                loop.handle(collated)
                policy.observe(*loop.last_batch)
                bar.update(len(collated["samples"]))
                t_wait = time.perf_counter()
            policy.settle()
            loop.writer.close()
    except BaseException:
        loop.writer.abort()
        raise
    finally:
        bar.close()
    return {**loop.result(time.perf_counter() - started), **policy.result()}


def teacher_threads(prepare_ms: float, teacher_ms: float, cores: int, workers: int, cap: int) -> tuple[int, float]:
    """Intra-op threads for a CPU teacher that shares ``cores`` with ``workers`` DataLoader workers,
    from the CPU milliseconds per sample of preparation (in the workers) and of the teacher forward;
    returns (threads, cores the preparation needs).

    When the build runs as fast as the cores allow, each stage needs cores in proportion to its CPU
    time per sample: preparation ``cores * p / (p + t)``, but never more than its workers can use;
    the teacher gets the rest, rounded to whole threads, at least 1 and at most ``cap`` (torch's
    thread count when the build started). A cheap teacher (random:tiny, preparation-bound) keeps
    ``cores - workers`` threads, as before: more would spin beside busy workers (measured on 2
    cores: 11 vs 28 samples/s with 1 thread). A heavy one (a ViT, MiniLM) gets every core: its
    workers sleep on a full prefetch queue most of the time, so a core kept for them idles.
    Without workers preparation runs in this process between forwards: the teacher gets every core.
    The worker count stays as given: the loader forks its workers once, and idle ones cost no CPU.
    """
    if workers <= 0:
        return max(1, min(cap, cores)), 0.0
    total = prepare_ms + teacher_ms
    prepare_cores = min(float(workers), cores * prepare_ms / total) if total > 0 else float(workers)
    return max(1, min(cap, cores, math.floor(cores - prepare_cores + 0.5))), prepare_cores


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _ThreadPolicy:
    """A CPU teacher's intra-op threads, chosen by ``teacher_threads`` from what the first batches
    measure. The first batch runs on every core (right for a heavy teacher, and a cheap one loses
    little in one batch); after it and after the second the threads are chosen again from that
    batch's figures, and the second choice is kept and printed. The teacher's CPU is the main
    thread's: exact on 1 thread; on more, its share of the work plus its spin-waits (below the
    teacher's whole CPU on idle cores), so a teacher not clearly heavier than preparation drops to
    fewer threads after the first batch and is measured on them in the second.
    GPU teachers: threads unchanged, nothing printed."""

    PROBE = 2

    def __init__(self, teachers, workers: int, say=None):
        self.cpu = not any(str(t.device).startswith("cuda") for t in teachers)
        self.workers, self.say = workers, say
        self.cap, self.cores = torch.get_num_threads(), _cores()
        self.seen, self.choice, self.printed = 0, None, False

    def start(self) -> None:
        if self.cpu:
            threads = max(1, min(self.cap, self.cores))
            torch.set_num_threads(threads)
            if self.workers <= 0:
                self._choose(threads, 0.0, None, None, threads, final=True)

    def observe(self, prepare_cpu: float, teacher_cpu: float, samples: int) -> None:
        """One batch's CPU seconds: preparation summed over its samples, the teacher's main thread."""
        if not self.cpu or self.workers <= 0 or self.seen >= self.PROBE or samples <= 0:
            return
        self.seen += 1
        measured_at = torch.get_num_threads()
        p, t = 1000 * prepare_cpu / samples, 1000 * teacher_cpu / samples
        threads, prepare_cores = teacher_threads(p, t, self.cores, self.workers, self.cap)
        torch.set_num_threads(threads)
        self._choose(threads, prepare_cores, p, t, measured_at, final=self.seen == self.PROBE)

    def settle(self) -> None:
        """At the end of the loop: print the choice if the build ended within the probe."""
        if self.choice and not self.printed:
            self._announce()

    def _choose(self, threads: int, prepare_cores: float, p, t, measured_at: int, final: bool) -> None:
        self.choice = {"teacher_threads": threads, "workers": self.workers, "cores": self.cores,
                       "teacher_cpu_ms_per_sample": None if t is None else round(t, 2),
                       "measured_at_threads": measured_at,
                       "prepare_cpu_ms_per_sample": None if p is None else round(p, 2),
                       "prepare_cores": round(prepare_cores, 3)}
        if final:
            self._announce()

    def _announce(self) -> None:
        c = self.choice
        if c["workers"] <= 0:
            why = "no workers, preparation runs in this process between the teacher's forwards"
        else:
            at = c["measured_at_threads"]
            why = (f"teacher {c['teacher_cpu_ms_per_sample']:.1f} ms/sample (main-thread CPU at {at} "
                   f"thread{'s' * (at != 1)}) vs preparation {c['prepare_cpu_ms_per_sample']:.1f} ms/sample "
                   f"(worker CPU), so preparation needs {c['prepare_cores']:.2f} of {c['cores']} cores")
        c["line"] = (f"cpu threads: teacher {c['teacher_threads']} thread{'s' * (c['teacher_threads'] != 1)}, "
                     f"{c['workers']} worker{'s' * (c['workers'] != 1)}: {why}")
        self.printed = True
        if self.say:
            self.say(c["line"], file=sys.stderr)

    def result(self) -> dict:
        return {"cpu_threads": self.choice} if self.choice else {}


@contextlib.contextmanager
def _cpu_settings(policy: _ThreadPolicy, workers: int):
    threads = torch.get_num_threads()
    policy.start()
    if workers > 0:
        # Workers fork when the loop starts and inherit every record; a garbage collection in a
        # worker would touch them all and copy their pages (copy-on-write): measured ~3 ms CPU
        # per sample on phantom:200. Frozen objects are never scanned; unfrozen when the build ends.
        gc.freeze()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if workers > 0:
            gc.unfreeze()


class _ShardLoop:
    """Main-process side: embed each batch, assemble its samples and feed the writer in order."""

    def __init__(self, todo, teachers, spec: PrepareSpec, opts: BuildOptions, out_dir: Path, skiplog,
                 fail_after_shards: int | None):
        self.teachers, self.spec, self.opts, self.skiplog = teachers, spec, opts, skiplog
        self.fail_after_shards, self.shards_done = fail_after_shards, 0
        self.remaining = {s.index: len(s.items) for s in todo}
        self.splits = {s.index: s.split for s in todo}
        self.timing = dict.fromkeys(TIMING_KEYS, 0.0)
        self.assemble_seconds = 0.0  # packing samples and queueing them to the writer
        self.stage_seconds: dict[str, float] = {}  # worker CPU seconds per preparation step
        # CPU seconds (wall lies on a busy machine): the teacher forwards on the main thread and in the
        # whole process (its intra-op threads, their spin-waits and the writer thread meanwhile), assembling
        self.main_cpu = {"teacher": 0.0, "teacher_process": 0.0, "assemble": 0.0}
        self.last_batch = (0.0, 0.0, 0)  # preparation CPU s, teacher main-thread CPU s, samples (thread policy)
        self.errors: dict[int, dict] = {}
        self.cosines: dict[int, dict] = {}
        self.position: dict[int, int] = {}
        self.current = None
        self.built = 0
        self.writer = BackgroundWriter(out_dir, maxsize=max(64, 4 * opts.batch_size),
                                       on_shard_done=self._on_shard_done, compression=opts.compression)

    def _on_shard_done(self, stats) -> None:
        self.shards_done += 1
        if self.fail_after_shards is not None and self.shards_done >= self.fail_after_shards:
            raise SimulatedKill(f"simulated kill after {self.shards_done} shard(s)")

    def handle(self, collated: dict) -> None:
        batch = collated["samples"]
        ok = [b for b in batch if "skip" not in b]
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        embs = embed_batch(self.teachers, ok, self.spec.images, crops=collated["crops"])
        t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
        self.main_cpu["teacher"] += c1 - c0
        self.main_cpu["teacher_process"] += p1 - p0
        self.timing["teacher"] += t1 - t0
        self.last_batch = (sum(sum(b.get("stage_seconds", {}).values()) for b in ok), c1 - c0, len(ok))
        emb_of = {b["key"]: e for b, e in zip(ok, embs)}
        for b in batch:
            self._write(b, emb_of)
        self.assemble_seconds += time.perf_counter() - t1
        self.main_cpu["assemble"] += time.thread_time() - c1

    def _write(self, b: dict, emb_of: dict) -> None:
        self.timing["decode_augment"] += b["prep_seconds"]
        for stage, seconds in b.get("stage_seconds", {}).items():
            self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + seconds
        shard = b["shard"]
        if shard != self.current:
            self.writer.begin(shard, self.splits[shard], self.remaining[shard])
            self.current = shard
        if "skip" in b:
            self.skiplog.skip(b["id"], b["skip"])
            self.writer.skip(b["id"], b["skip"])
        else:
            sample = assemble_sample(b, emb_of[b["key"]], self.spec.image_format, self.opts.emb_dtype,
                                     self.errors.setdefault(shard, {}), self.cosines.setdefault(shard, {}))
            self.writer.add(sample, {**b["row"], "shard": shard_name(shard, self.opts.compression),
                                     "index_in_shard": self.position.get(shard, 0)})
            self.position[shard] = self.position.get(shard, 0) + 1
            self.built += 1
        self.remaining[shard] -= 1
        if self.remaining[shard] == 0:
            self.writer.end({"teachers": [t.name for t in self.teachers],
                             "int8_max_abs_error": self.errors.pop(shard, {}) or None,
                             "int8_min_cosine": self.cosines.pop(shard, {}) or None})
            self.current = None

    def result(self, pipeline_seconds: float) -> dict:
        self.timing["write"] = self.writer.write_seconds
        return {"samples_built": self.built, "pipeline_seconds": round(pipeline_seconds, 3),
                "time_split_seconds": {k: round(v, 3) for k, v in self.timing.items()},
                "assemble_seconds": round(self.assemble_seconds, 3),
                "prepare_cpu_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
                "main_cpu_seconds": {k: round(v, 3) for k, v in self.main_cpu.items()}}


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
