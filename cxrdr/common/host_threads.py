"""CPU threads for a process's own small tensor and BLAS work when its model runs on a GPU.

torch's intra-op pool (a thread a core) and the BLAS pool split each small operation across every core, then
wait at a barrier for the slowest thread. Beside busy loader workers, or a second process doing the same, those
threads are descheduled and every small operation waits for them: on this 2-core box, with two busy processes
beside it, a pass's retrieval and quick probe on 512 rows took 1.07 s on 2 threads and 0.24 s on 1 (idle: 0.16
and 0.16 s; ``python benchmarks/host_threads.py``). On the H200, two recipe copies with their loader workers made a
validation pass's retrieval take 0.7 s (10 ms here), and a run's final evaluation did not end in 170 s
(docs/gpu.md, "Seventh GPU session").
So a process whose model is on a GPU keeps its threads to the cores its workers leave, and work between GPU
batches (evaluations, validation passes) runs on one thread. The CPU path keeps every core: there the threads do
the model's work.
"""
from __future__ import annotations

import contextlib
import os

import torch


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def gpu_host_workers(cores: int, processes: int = 1) -> int:
    """Loader workers each of ``processes`` alike processes feeding a GPU (DDP ranks on one host) takes by default:
    the host's ``cores`` but two (its own thread and the OS), shared between them, at least 2 and at most 16 each.
    The rule of ``reinforce build`` (whose teacher waits on preparation) and of ``train run`` (whose step outruns
    two workers several times) alike."""
    return max(2, min(16, (cores - 2) // max(1, processes)))


def threads_beside(workers: int, cap: int | None = None, processes: int = 1) -> int:
    """Intra-op threads for each of ``processes`` alike processes (DDP ranks on one host) that leave each one's
    ``workers`` loader workers a core each: at least 1, at most ``cap`` (default: torch's current count, which
    honours OMP_NUM_THREADS)."""
    cap = torch.get_num_threads() if cap is None else cap
    processes = max(1, processes)
    return max(1, min(cap, (available_cores() - processes * max(0, workers)) // processes))


@contextlib.contextmanager
def host_threads(threads: int | None):
    """torch's intra-op threads and every BLAS/OpenMP pool (threadpoolctl, scikit-learn's own dependency)
    at ``threads`` inside the block, restored after it; None changes nothing."""
    if threads is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads):
            yield
    finally:
        torch.set_num_threads(before)
