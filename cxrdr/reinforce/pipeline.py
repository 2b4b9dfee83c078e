"""The shard loop of one rank (or one Ray actor): prepare (DataLoader workers or this process)
-> embed (this process) -> write (a background thread), for the pending shards of the plan.

Workers hand over chunks of about B/(2*workers) records with their crops in one tensor per
teacher size; this process regroups them into batches of B = ``--batch-size`` records for the
teacher forwards and queues each batch's records with their embeddings to the writer thread,
which assembles the samples and writes the tars while this process loads and embeds the next
batches (``writer.BackgroundWriter``), renaming each shard's tar with its stats file when
complete. With CUDA teachers the replay and forwards of each batch run in an embedding thread while this
one takes the next batch from the loader (``_EmbeddingThread``), and the thread waits for a batch's rows only
once the next batch's forwards are queued behind them (``_ShardLoop.handle``, ``embed.QueuedBatch``). With a
CPU teacher the first two batches are prepared in this process and timed; from them ``where_to_prepare``
chooses where the rest is prepared (here, or in the workers) and the teacher's intra-op threads, and the choice
is printed (``cpu_policy``). The shards do not depend
on the choice, nor on the writer thread (``run_shards(overlap_writes=False)`` writes in turn).

``--replay`` (``options.resolve_replay``): ``cpu`` has the workers replay each image's K views;
``device`` has them only decode, and this process replays each batch's views at once on the
teachers' device just before the forward (``prepare.replay_on_device``), timed as ``replay``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from cxrdr.common.shards import shard_name
from cxrdr.reinforce.assemble import assemble_sample
from cxrdr.reinforce.cpu_policy import CpuPolicy, cpu_settings
from cxrdr.reinforce.embed import QueuedBatch, queue_batch
from cxrdr.reinforce.options import BuildOptions, resolve_replay
from cxrdr.reinforce.plan import ShardPlan
from cxrdr.reinforce.prepare import PrepareDataset, PrepareSpec, collate_prepared, pad_cat, replay_on_device
from cxrdr.reinforce.writer import BackgroundWriter

# write: the writer thread's seconds writing tars; write_wait: this process blocked on the writer
# (its queue full, and at the end until the last shard is written)
TIMING_KEYS = ("decode_augment", "teacher", "write", "loader_wait", "write_wait")
WRITER_QUEUE_BATCHES = 4  # batches waiting for the writer thread at most (memory stays flat)


class SimulatedKill(RuntimeError):
    """Raised by the test hook ``fail_after_shards`` to mimic a build killed partway."""


def run_shards(todo: list[ShardPlan], teachers, spec: PrepareSpec, opts: BuildOptions, out_dir: Path,
               skiplog, fail_after_shards: int | None, rank: int, announce: bool = True, captioner=None,
               overlap_writes: bool = True, overlap_teachers: bool | None = None) -> dict:
    """Build the shards ``todo``; returns the rank's timing and counts, and where the views were
    replayed (``replay``: cpu or device, None without image teachers). ``announce``: print the CPU
    choice (with ``opts.progress``). ``captioner``: makes the captions from the image rows
    (``cxrdr.reinforce.captioners``; ``spec.captioner`` must then be true). ``overlap_writes=False``
    (internal, the tests' reference): assemble and write in this thread, between the batches; the
    shards are the same bytes. ``overlap_teachers`` (None: with CUDA teachers): each batch's replay and
    forwards run in an embedding thread (``_EmbeddingThread``) while this thread takes the next batch
    from the loader; the same shards."""
    device = next((str(t.device) for t in teachers if t.has_images), "cpu")
    spec = dataclasses.replace(spec, replay=resolve_replay(opts.replay, device))
    replay = {"replay": spec.replay if spec.sizes else None}
    items = [(s.index, key, rec) for s in todo for key, rec in s.items]
    if not items:
        return {"samples_built": 0, "pipeline_seconds": 0.0, "time_split_seconds": dict.fromkeys(TIMING_KEYS, 0.0),
                **replay}
    started = time.perf_counter()
    bar = tqdm(total=len(items), unit="rec", desc=f"build[{rank}]", disable=not opts.progress)
    policy = CpuPolicy(teachers, opts.workers, say=bar.write if announce and opts.progress else None)
    threaded = not policy.cpu if overlap_teachers is None else overlap_teachers
    loop = _ShardLoop(todo, teachers, spec, opts, out_dir, skiplog, fail_after_shards, device, captioner,
                      overlap_writes, pipelined=threaded)
    embedder = _EmbeddingThread(loop, policy, bar, threaded=threaded)
    try:
        with cpu_settings(policy, opts.workers):
            t_wait = time.perf_counter()
            for collated in _regroup(_prepared_chunks(items, spec, opts, policy), opts.batch_size):
                loop.timing["loader_wait"] += time.perf_counter() - t_wait
                if loop.first_batch_seconds is None:
                    loop.first_batch_seconds = time.perf_counter() - started
                embedder.submit(collated)
                t_wait = time.perf_counter()
            embedder.finish()  # the last batch embedded and queued; raises its failure
            loop.drain()  # pipelined: its rows waited for, its records to the writer
            policy.settle()
            loop.writer.close()  # waits for the last shard; raises a writer failure
    finally:
        # Whatever raised here (the loader, a teacher, the writer, Ctrl-C): the batch being embedded ends
        # first, then (pipelined) the batch in hand reaches the writer, then the shards already queued
        # complete, the one left incomplete is dropped, and the writer thread is joined. After a close this
        # does nothing.
        embedder.stop()
        loop.drain_after_failure()
        loop.writer.abort()
        bar.close()
    return {**loop.result(time.perf_counter() - started), **policy.result(), **replay}


def _prepared_chunks(items: list, spec: PrepareSpec, opts: BuildOptions, policy: CpuPolicy):
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


class _EmbeddingThread:
    """Hands each batch to ``_ShardLoop.handle`` (replay, forwards, queueing to the writer), in this thread or,
    ``threaded``, in one embedding thread, one batch at a time and in order: while it embeds batch n, the build's
    thread takes batch n+1 from the loader (receiving and regrouping the workers' chunks), work that would
    otherwise leave a GPU teacher idle between its forwards. Waiting on the GPU releases the GIL, so the two
    threads overlap. Not for CPU teachers: their forwards take every core (``cpu_policy``)."""

    def __init__(self, loop: "_ShardLoop", policy: CpuPolicy, bar, threaded: bool):
        self.loop, self.policy, self.bar = loop, policy, bar
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="teacher") if threaded else None
        self.pending: Future | None = None

    def submit(self, collated: dict) -> None:
        self.finish()
        if self.pool is None:
            self._handle(collated)
        else:
            self.pending = self.pool.submit(self._handle, collated)

    def finish(self) -> None:
        """Wait for the batch in hand; raises its failure."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _handle(self, collated: dict) -> None:
        self.loop.handle(collated)
        self.policy.observe(*self.loop.last_batch)
        self.bar.update(len(collated["samples"]))


class _ShardLoop:
    """Main-process side: embed each batch and queue its records with their embeddings to the writer
    thread in order (one queue item a batch), which assembles the samples (``_assemble``) and writes."""

    def __init__(self, todo, teachers, spec: PrepareSpec, opts: BuildOptions, out_dir: Path, skiplog,
                 fail_after_shards: int | None, device: str, captioner=None, overlap_writes: bool = True,
                 pipelined: bool = False):
        self.teachers, self.spec, self.opts, self.skiplog, self.device = teachers, spec, opts, skiplog, device
        # pipelined (the embedding thread's, with CUDA teachers): a batch is completed once the next one's forwards
        # are queued, so the GPU goes from one batch to the next without waiting for this process
        self.pipelined, self.pending = pipelined, None
        self.captioner = captioner
        self.fail_after_shards, self.shards_done = fail_after_shards, 0
        self.remaining = {s.index: len(s.items) for s in todo}
        self.splits = {s.index: s.split for s in todo}
        # replay: this process's replay of the views before the forwards (--replay device only)
        self.timing = dict.fromkeys(TIMING_KEYS + (("replay",) if spec.replay == "device" else ()), 0.0)
        self.stage_seconds: dict[str, float] = {}  # worker CPU seconds per preparation step
        # CPU seconds (wall lies on a busy machine): the teacher forwards on the main thread and in the
        # whole process (its intra-op threads, their spin-waits and the writer thread meanwhile);
        # queue: handing the batches to the writer (main thread); assemble: packing the samples (writer thread)
        self.main_cpu = {"teacher": 0.0, "teacher_process": 0.0, "queue": 0.0}
        self.first_batch_seconds: float | None = None  # from the start to the first batch in this loop
        self.last_batch = (0.0, 0.0, 0)  # preparation wall s (summed), replay + teacher wall s, samples (CPU policy)
        self.errors: dict[int, dict] = {}
        self.cosines: dict[int, dict] = {}
        self.position: dict[int, int] = {}
        self.current = None
        self.built = 0
        self.writer = BackgroundWriter(out_dir, maxsize=WRITER_QUEUE_BATCHES, on_shard_done=self._on_shard_done,
                                       compression=opts.compression, threaded=overlap_writes)

    def _on_shard_done(self, stats) -> None:
        self.shards_done += 1
        if self.fail_after_shards is not None and self.shards_done >= self.fail_after_shards:
            raise SimulatedKill(f"simulated kill after {self.shards_done} shard(s)")

    def handle(self, collated: dict) -> None:
        """Replay the batch's views and queue its forwards; then, pipelined, complete the batch before it (its rows
        waited for, its records queued to the writer) while this one runs on the GPU, else complete this one."""
        batch = collated["samples"]
        ok = [b for b in batch if "skip" not in b]
        crops, replay = collated["crops"], None
        started, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        if "pixels" in collated:
            replay = _ReplayTimer(self.device)
            with replay:
                crops = replay_on_device(collated["pixels"], ok, self.spec.sizes, self.device)
        replayed = time.perf_counter()
        try:
            queued = queue_batch(self.teachers, ok, self.spec.images, crops=crops, captioner=self.captioner,
                                 n_captions=self.spec.n_captions)
        except BaseException:
            self.drain()  # the batches before this one complete their shards
            raise
        issued = _Issued(batch, ok, queued, replay, replayed - started, time.perf_counter() - replayed,
                         time.thread_time() - c0, time.process_time() - p0)
        previous, self.pending = self.pending, issued
        if previous is not None:
            self._complete(previous)
        if not self.pipelined:
            self.drain()

    def drain(self) -> None:
        """Complete the batch still in hand, if any (the end of the build)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._complete(pending)

    def drain_after_failure(self) -> None:
        """After a failure elsewhere (the loader, Ctrl-C): the batch in hand was embedded, so its records still go
        to the writer and the shards they complete are kept. A failure here (the teacher's or the writer's, which
        stopped the build already) is not raised over the first."""
        with contextlib.suppress(Exception):
            self.drain()

    def _complete(self, issued: "_Issued") -> None:
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        embs = issued.queued.result()
        waited = time.perf_counter() - t0
        c1 = time.thread_time()
        replay_seconds = issued.replay.seconds() if issued.replay else 0.0  # on CUDA its kernels' time, ended by now
        if issued.replay:
            self.timing["replay"] += replay_seconds
        self.main_cpu["teacher"] += issued.thread_cpu + c1 - c0
        self.main_cpu["teacher_process"] += issued.process_cpu + time.process_time() - p0
        # the forwards' wall time: queuing them and waiting for their rows. On CUDA the replay's kernels ran in the
        # same stream before them, without a wait between (a wait there left the GPU idle while the forwards were
        # being queued), so that wait may hold them: they are not counted twice
        gpu_replay = replay_seconds if issued.replay and issued.replay.on_gpu else 0.0
        self.timing["teacher"] += max(0.0, issued.issue_seconds + waited - gpu_replay)
        # the CPU policy weighs this process's work against the workers': replay is part of it
        self.last_batch = (sum(b["prep_seconds"] for b in issued.ok),
                           issued.replay_seconds + issued.issue_seconds + waited, len(issued.ok))
        emb_of = {b["key"]: e for b, e in zip(issued.ok, embs)}
        for b in issued.batch:
            self._write(b, emb_of)
        self.writer.flush()  # the batch as one queue item; raises a writer failure
        self.main_cpu["queue"] += time.thread_time() - c1

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
        else:  # assembled in the writer thread (the int8 quality dicts are the writer thread's alone)
            self.writer.add(functools.partial(self._assemble, b, emb_of[b["key"]], shard),
                            {**b["row"], "shard": shard_name(shard, self.opts.compression),
                             "index_in_shard": self.position.get(shard, 0)})
            self.position[shard] = self.position.get(shard, 0) + 1
            self.built += 1
        self.remaining[shard] -= 1
        if self.remaining[shard] == 0:
            self.writer.end(functools.partial(self._shard_extra, shard))
            self.current = None

    # writer thread (or this one, overlap_writes=False) --------------------------------------
    def _assemble(self, b: dict, embeddings: dict, shard: int) -> dict:
        return assemble_sample(b, embeddings, self.spec.image_format, self.opts.emb_dtype,
                               self.errors.setdefault(shard, {}), self.cosines.setdefault(shard, {}))

    def _shard_extra(self, shard: int) -> dict:
        return {"teachers": [t.name for t in self.teachers],
                "int8_max_abs_error": self.errors.pop(shard, {}) or None,
                "int8_min_cosine": self.cosines.pop(shard, {}) or None}

    def result(self, pipeline_seconds: float) -> dict:
        self.timing["write"] = self.writer.write_seconds
        self.timing["write_wait"] = self.writer.wait_seconds  # full queue, and close() until the last shard
        main_cpu = {**self.main_cpu, "assemble": self.writer.assemble_cpu_seconds}
        return {"samples_built": self.built, "pipeline_seconds": round(pipeline_seconds, 3),
                "first_batch_seconds": round(self.first_batch_seconds or 0.0, 3),
                "time_split_seconds": {k: round(v, 3) for k, v in self.timing.items()},
                "assemble_seconds": round(self.writer.assemble_seconds, 3),
                "prepare_cpu_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
                "main_cpu_seconds": {k: round(v, 3) for k, v in main_cpu.items()}}


@dataclasses.dataclass
class _Issued:
    """A batch whose forwards are queued (``_ShardLoop.handle``), waiting for ``_ShardLoop._complete``."""
    batch: list
    ok: list
    queued: QueuedBatch
    replay: "_ReplayTimer | None"
    replay_seconds: float  # wall, queuing the replay (on CUDA) or running it
    issue_seconds: float  # wall, queuing the forwards (on CUDA) or running them
    thread_cpu: float
    process_cpu: float


class _ReplayTimer:
    """The replay's time: on CUDA between two events around its kernels, read once the batch's forwards have
    ended (no wait for the GPU of its own), elsewhere its wall time."""

    def __init__(self, device: str):
        self.on_gpu = str(device).startswith("cuda")
        self.stream = torch.cuda.current_stream(device) if self.on_gpu else None
        self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if self.on_gpu else (None,) * 2
        self.wall = 0.0

    def __enter__(self):
        if self.on_gpu:
            self.start.record(self.stream)
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        if self.on_gpu:
            self.end.record(self.stream)

    def seconds(self) -> float:
        if not self.on_gpu:
            return self.wall
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0


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
        out = {"samples": [b for c in pending for b in c["samples"]],
               "crops": {size: torch.cat([c["crops"][size] for c in pending if size in c["crops"]])
                         for size in sizes}}
        pixels = [c["pixels"] for c in pending if "pixels" in c]
        if pixels:
            out["pixels"] = pad_cat(pixels)
        return out

    count = 0
    for chunk in chunks:
        pending.append(chunk)
        count += len(chunk["samples"])
        if count >= batch_size:
            yield merged()
            pending, count = [], 0
    if pending:
        yield merged()
