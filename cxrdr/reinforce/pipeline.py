"""The shard loop of one rank (or one Ray actor): prepare (DataLoader workers or this process)
-> embed (this process) -> write (a background thread), for the pending shards of the plan.

Workers hand over chunks of about B/(2*workers) records with their crops in one tensor per
teacher size; this process regroups them into batches of B = ``--batch-size`` records for the
teacher forwards, assembles the samples and queues them to the writer, which renames each
shard's tar with its stats file when complete. With a CPU teacher the first two batches are
prepared in this process and timed; from them ``where_to_prepare`` chooses where the rest is
prepared (here, or in the workers) and the teacher's intra-op threads, and the choice is printed
(``_CpuPolicy``). The shards do not depend on the choice.
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
    CPU choice (with ``opts.progress``)."""
    items = [(s.index, key, rec) for s in todo for key, rec in s.items]
    if not items:
        return {"samples_built": 0, "pipeline_seconds": 0.0, "time_split_seconds": dict.fromkeys(TIMING_KEYS, 0.0)}
    started = time.perf_counter()
    loop = _ShardLoop(todo, teachers, spec, opts, out_dir, skiplog, fail_after_shards)
    bar = tqdm(total=len(items), unit="rec", desc=f"build[{rank}]", disable=not opts.progress)
    policy = _CpuPolicy(teachers, opts.workers, say=bar.write if announce and opts.progress else None)
    try:
        with _cpu_settings(policy, opts.workers):
            t_wait = time.perf_counter()
            for collated in _regroup(_prepared_chunks(items, spec, opts, policy), opts.batch_size):
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


def _prepared_chunks(items: list, spec: PrepareSpec, opts: BuildOptions, policy: "_CpuPolicy"):
    """Prepared chunks in order: the policy's probe batches in this process, then the rest where the
    policy chose (this process, or ``--workers`` DataLoader workers). Lazy: ``_regroup`` hands each
    probe batch to the teacher (and the policy) before the next chunk is asked for."""
    probe = policy.probe_records(opts.batch_size)
    yield from _loader(items[:probe], spec, opts.batch_size, workers=0)
    yield from _loader(items[probe:], spec, opts.batch_size, workers=policy.workers_to_use())


def _loader(items: list, spec: PrepareSpec, batch_size: int, workers: int):
    if not items:
        return iter(())
    # Workers prepare chunks smaller than a teacher batch, so all of them work on the first batch
    # (a whole batch per worker would leave the teacher idle for a full batch's preparation at
    # the start). The main process regroups the chunks into the same --batch-size batches.
    chunk = _chunk_size(batch_size, workers)
    return iter(torch.utils.data.DataLoader(
        PrepareDataset(items, spec), batch_size=chunk, shuffle=False,
        num_workers=workers, collate_fn=collate_prepared,
        prefetch_factor=max(2, -(-batch_size // chunk)) if workers > 0 else None,
        persistent_workers=False))


def teacher_threads(prepare_ms: float, teacher_ms: float, cores: int, workers: int, cap: int) -> tuple[int, float]:
    """Intra-op threads for a CPU teacher that shares ``cores`` with ``workers`` DataLoader workers,
    from the CPU milliseconds per sample of preparation and of the teacher forward; returns
    (threads, cores the preparation needs).

    When the build runs as fast as the cores allow, each stage needs cores in proportion to its CPU
    time per sample: preparation ``cores * p / (p + t)``, but never more than its workers can use.
    Those cores, rounded up, are left to the workers: a worker that takes a core from one of the
    forward's threads stalls all of them until that one catches up (on 2 cores MiniLM on both
    cores slowed 13 % beside a worker busy 6 % of the time). The teacher gets the rest, at least 1
    thread and at most ``cap`` (torch's thread count when the build started). Without workers
    preparation runs in this process between forwards: the teacher gets every core.
    """
    if workers <= 0:
        return max(1, min(cap, cores)), 0.0
    total = prepare_ms + teacher_ms
    prepare_cores = min(float(workers), cores * prepare_ms / total) if total > 0 else float(workers)
    return max(1, min(cap, cores - math.ceil(prepare_cores - 1e-9))), prepare_cores


def where_to_prepare(prepare_ms: float, teacher_ms: float, cores: int, workers: int, cap: int) -> dict:
    """Prepare in this process or in ``workers`` DataLoader workers, from one sample's preparation
    and teacher-forward wall milliseconds, both measured in this process with the teacher on every
    core (``cap`` threads at most). Returns the choice, the teacher's threads and the estimated wall
    milliseconds per sample of each way.

    In this process a sample takes ``p + t``: preparation and the forward in turn, the forward on
    every core. With workers the teacher gets ``teacher_threads`` threads, the cores the workers
    need being left to them, so its forward takes about ``t * cores / threads`` while preparation
    takes ``p / workers`` beside it. A heavy teacher on few cores is therefore better off preparing
    in turn (MiniLM on 2 cores: ~31 ms a sample so, while its forward alone takes 51 ms on one
    thread), a cheap one or many cores with workers. A tie goes to this process (no fork, no copies
    between processes).
    """
    every_core = max(1, min(cap, cores))
    in_process = prepare_ms + teacher_ms
    if workers <= 0:
        return {"workers_used": 0, "teacher_threads": every_core, "in_process_ms": in_process,
                "with_workers_ms": None, "prepare_cores": 0.0}
    # The forward's CPU: its wall time on every core times those cores (its threads spin-wait too).
    threads, prepare_cores = teacher_threads(prepare_ms, teacher_ms * every_core, cores, workers, cap)
    with_workers = max(teacher_ms * every_core / threads, prepare_ms / workers)
    here = in_process <= with_workers
    return {"workers_used": 0 if here else workers, "teacher_threads": every_core if here else threads,
            "in_process_ms": in_process, "with_workers_ms": with_workers, "prepare_cores": prepare_cores}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _CpuPolicy:
    """Where a CPU teacher's build prepares its records and how many threads the teacher gets,
    chosen by ``where_to_prepare`` from what the first batches measure. The first ``PROBE``
    batches are prepared in this process, one after the other with the forward on every core, so
    that both costs are measured alone; the second batch's figures (past the forward's first-call
    costs) decide, the choice is printed and kept for the rest of the build. The worker count is
    the given one or none. Without workers, or with a GPU teacher, nothing is probed: GPU teachers
    keep the threads and workers as given and print nothing."""

    PROBE = 2

    def __init__(self, teachers, workers: int, say=None):
        self.cpu = not any(str(t.device).startswith("cuda") for t in teachers)
        self.workers, self.say = workers, say
        self.cap, self.cores = torch.get_num_threads(), _cores()
        self.every_core = max(1, min(self.cap, self.cores))  # the teacher's threads while probing
        self.seen, self.measured, self.choice = 0, None, None

    @property
    def probing(self) -> bool:
        return self.cpu and self.workers > 0

    def start(self) -> None:
        if self.cpu:
            torch.set_num_threads(self.every_core)
            if self.workers <= 0:
                self._decide(None, None)

    def probe_records(self, batch_size: int) -> int:
        """Records to prepare in this process before the choice."""
        return self.PROBE * batch_size if self.probing else 0

    def observe(self, prepare_seconds: float, teacher_seconds: float, samples: int) -> None:
        """One batch: preparation wall seconds summed over its samples, the teacher's wall seconds."""
        if not self.probing or self.seen >= self.PROBE or samples <= 0:
            return
        self.seen += 1
        self.measured = (1000 * prepare_seconds / samples, 1000 * teacher_seconds / samples)
        if self.seen == self.PROBE:
            self._decide(*self.measured)

    def workers_to_use(self) -> int:
        """The workers for the records after the probe (decides now if the probe saw fewer batches)."""
        if not self.probing:
            return self.workers
        if self.choice is None:
            self._decide(*(self.measured or (None, None)))
        return self.choice["workers_used"]

    def settle(self) -> None:
        """At the end of the loop: decide and print if the build ended within the probe."""
        if self.probing and self.choice is None and self.measured:
            self._decide(*self.measured)

    def _decide(self, p, t) -> None:
        if p is None:  # no workers, or no probe sample measured (all skipped): the given workers
            threads, prepare_cores = teacher_threads(1.0, 0.0, self.cores, self.workers, self.cap)
            c = {"workers_used": self.workers, "teacher_threads": threads, "in_process_ms": None,
                 "with_workers_ms": None, "prepare_cores": prepare_cores}
        else:
            c = where_to_prepare(p, t, self.cores, self.workers, self.cap)
        torch.set_num_threads(c["teacher_threads"])
        self.choice = {"teacher_threads": c["teacher_threads"], "workers": self.workers,
                       "workers_used": c["workers_used"], "cores": self.cores,
                       "measured_at_threads": self.every_core,
                       "prepare_ms_per_sample": None if p is None else round(p, 2),
                       "teacher_ms_per_sample": None if t is None else round(t, 2),
                       "in_process_ms_per_sample": None if c["in_process_ms"] is None else round(c["in_process_ms"], 2),
                       "with_workers_ms_per_sample": (None if c["with_workers_ms"] is None
                                                      else round(c["with_workers_ms"], 2)),
                       "prepare_cores": round(c["prepare_cores"], 3)}
        self._announce()

    def _announce(self) -> None:
        c = self.choice
        threads = f"{c['teacher_threads']} thread{'s' * (c['teacher_threads'] != 1)}"
        given = f"{c['workers']} worker{'s' * (c['workers'] != 1)}"
        if c["workers"] <= 0:
            c["line"] = (f"cpu threads: teacher {threads}, no workers: preparation runs in this process "
                         f"between the teacher's forwards")
        elif c["prepare_ms_per_sample"] is None:
            c["line"] = f"cpu threads: teacher {threads}, {given}: no probe batch was measured"
        else:
            at = c["measured_at_threads"]
            costs = (f"per sample, preparation {c['prepare_ms_per_sample']:.1f} ms and the teacher "
                     f"{c['teacher_ms_per_sample']:.1f} ms on {at} thread{'s' * (at != 1)}")
            here = f"in this process {c['in_process_ms_per_sample']:.1f} ms"
            away = f"with {given} about {c['with_workers_ms_per_sample']:.1f} ms"
            if c["workers_used"] == 0:
                c["line"] = (f"cpu threads: teacher {threads}, preparation in this process instead of "
                             f"{given}: {costs}; {here}, {away}")
            else:
                c["line"] = f"cpu threads: teacher {threads}, {given}: {costs}; {away}, {here}"
        if self.say:
            self.say(c["line"], file=sys.stderr)

    def result(self) -> dict:
        return {"cpu_threads": self.choice} if self.choice else {}


@contextlib.contextmanager
def _cpu_settings(policy: _CpuPolicy, workers: int):
    threads = torch.get_num_threads()
    policy.start()
    if workers > 0:
        # Workers fork when their loader starts and inherit every record; a garbage collection in a
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
        self.last_batch = (0.0, 0.0, 0)  # preparation wall s (summed), teacher wall s, samples (CPU policy)
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
        self.last_batch = (sum(b["prep_seconds"] for b in ok), t1 - t0, len(ok))
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
