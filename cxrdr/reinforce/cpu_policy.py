"""Where a build with a CPU teacher prepares its records, and how many threads its teacher gets.

The first ``CpuPolicy.PROBE`` batches are prepared in the build's process, in turn with the forward
on every core, so that preparation and forward are each timed alone; from them ``where_to_prepare``
chooses between preparing in turn in this process and preparing in the DataLoader workers beside a
teacher that keeps only the cores they leave (``teacher_threads``). The choice is printed once and
stored in ``dataset.json`` (``build.ranks[].cpu_threads``). GPU teachers keep the given workers, and
the build's process keeps its threads to the cores the workers leave (recorded there, not printed).
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch

from cxrdr.common.heap import frozen_heap
from cxrdr.common.host_threads import available_cores, threads_beside


def every_core(cores: int, cap: int) -> int:
    """The teacher's threads when it has the cores to itself: every core, at most ``cap``."""
    return max(1, min(cap, cores))


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
        return every_core(cores, cap), 0.0
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
    alone = every_core(cores, cap)
    in_process = prepare_ms + teacher_ms
    if workers <= 0:
        return {"workers_used": 0, "teacher_threads": alone, "in_process_ms": in_process,
                "with_workers_ms": None, "prepare_cores": 0.0}
    # The forward's CPU: its wall time on every core times those cores (its threads spin-wait too).
    threads, prepare_cores = teacher_threads(prepare_ms, teacher_ms * alone, cores, workers, cap)
    with_workers = max(teacher_ms * alone / threads, prepare_ms / workers)
    here = in_process <= with_workers
    return {"workers_used": 0 if here else workers, "teacher_threads": alone if here else threads,
            "in_process_ms": in_process, "with_workers_ms": with_workers, "prepare_cores": prepare_cores}


class CpuPolicy:
    """Where a CPU teacher's build prepares its records and how many threads the teacher gets,
    chosen by ``where_to_prepare`` from what the first batches measure. The first ``PROBE``
    batches are prepared in this process, one after the other with the forward on every core, so
    that both costs are measured alone; the second batch's figures (past the forward's first-call
    costs) decide, the choice is printed and kept for the rest of the build. The worker count is
    the given one or none. Without workers, or with a GPU teacher, nothing is probed: GPU teachers
    keep the workers as given, the build's process keeps its threads to the cores they leave, and
    nothing is printed."""

    PROBE = 2

    def __init__(self, teachers, workers: int, say=None):
        self.cpu = not any(str(t.device).startswith("cuda") for t in teachers)
        self.workers, self.say = workers, say
        self.cap, self.cores = torch.get_num_threads(), available_cores()
        self.every_core = every_core(self.cores, self.cap)  # the teacher's threads while probing
        self.seen, self.measured, self.choice = 0, None, None

    @property
    def probing(self) -> bool:
        return self.cpu and self.workers > 0

    def start(self) -> None:
        if self.cpu:
            torch.set_num_threads(self.every_core)
            if self.workers <= 0:
                self._decide(None, None)
        elif self.workers > 0:
            self._leave_workers_their_cores()

    def _leave_workers_their_cores(self) -> None:
        """A GPU teacher's build process does little CPU work of its own (regrouping the workers' chunks,
        copies, the writer's encoding): its intra-op threads keep to the cores the workers leave, as every process
        beside loader workers with its model on a GPU does (``cxrdr.common.host_threads.threads_beside``), instead of
        one spinning thread a core beside them. On the H100 the 12 workers of a 16-core build took 13.8 ms of wall
        time a sample at 0ef6026, with torch's default threads here; 9.7 ms at 48c40d0 with 4, for 6.5 ms of their
        CPU (docs/gpu.md, "Third H100 session")."""
        threads = threads_beside(self.workers, self.cap)
        torch.set_num_threads(threads)
        self.choice = {"teacher_threads": threads, "workers": self.workers, "workers_used": self.workers,
                       "cores": self.cores, "line": f"cpu threads: the build's process {threads}, {self.workers} "
                                                    f"worker{'s' * (self.workers != 1)} (GPU teacher)"}

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
def cpu_settings(policy: CpuPolicy, workers: int):
    threads = torch.get_num_threads()
    policy.start()
    # Workers fork when their loader starts and inherit every record; a garbage collection in a
    # worker would touch them all and copy their pages (copy-on-write): measured ~3 ms CPU
    # per sample on phantom:200. Frozen objects are never scanned; unfrozen when the build ends.
    try:
        with frozen_heap() if workers > 0 else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(threads)
