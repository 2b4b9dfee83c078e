"""Tasks run in the order given on one background thread, a few at most waiting: add-teacher's shard writing.

Why a thread of our own rather than handing the tasks to ``concurrent.futures`` alone: after a task fails, the
ones queued behind it must not run. add-teacher queues a shard's batches, then the rename that replaces the shard
(``ShardRewrite.finish``); a rename after a failed batch would put a shard missing samples in place of a whole one.
A single-thread executor would go on to the next task. Why a thread at all: the writing is tar headers, CRC-32s
and deflate (zlib releases the GIL for its bulk) and file writes, while this process's other work is waiting for
its loader workers and for the GPU's forwards; a process would have to be sent every batch's samples.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class OrderedTasks:
    """``submit(fn, *args)`` runs ``fn(*args)`` on one background thread, in submission order; at most ``depth``
    submitted tasks are unfinished (``submit`` waits for the oldest beyond that). The first failure is raised by the
    next ``submit`` or by ``close``, and no later task runs. ``close`` waits for every task; call it before touching
    what the tasks use. ``busy_seconds``: the thread's time in the tasks; ``wait_seconds``: the caller's, blocked."""

    def __init__(self, depth: int = 4, name: str = "ordered-tasks"):
        self.depth = depth
        self.busy_seconds = 0.0
        self.wait_seconds = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._unfinished: collections.deque[Future] = collections.deque()
        self._failed = threading.Event()

    def submit(self, fn: Callable, *args) -> None:
        while self._unfinished and (self._unfinished[0].done() or len(self._unfinished) >= self.depth):
            self._wait_oldest()
        self._unfinished.append(self._pool.submit(self._run, fn, *args))

    def close(self) -> None:
        """Wait for every submitted task (raising the first failure) and end the thread."""
        try:
            while self._unfinished:
                self._wait_oldest()
        finally:
            self._pool.shutdown(wait=True)

    def _wait_oldest(self) -> None:
        started = time.perf_counter()
        try:
            self._unfinished.popleft().result()
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _run(self, fn: Callable, *args):
        if self._failed.is_set():
            raise RuntimeError("not run: an earlier task failed")
        started = time.perf_counter()
        try:
            return fn(*args)
        except BaseException:
            self._failed.set()
            raise
        finally:
            self.busy_seconds += time.perf_counter() - started
