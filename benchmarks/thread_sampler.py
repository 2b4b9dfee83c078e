"""Where each thread of this process spends its wall time, by sampling every thread's Python stack.

The build's process runs three threads of its own on a GPU (the build's, the embedding thread, the writer) and
the question is which one waits and where. cProfile cannot answer it on Python >= 3.12: its profiler is
process-wide there (``sys.monitoring``), so a second one, one a thread, fails with "Another profiling tool is
already active", and the threads that hook raised in never ran (the H100 lease at 416dba0: the build hung). A
sampler needs no hook in the threads and costs the same on every Python: every ``interval`` seconds it reads
``sys._current_frames()`` and counts, per thread, the function at the top of each stack (own) and every function
on it (cumulative). A thread blocked in C (a CUDA wait, a queue) is counted at the Python line that called in,
so waits show up as time, which a deterministic profiler of Python calls would not attribute.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from pathlib import Path


def _function(frame) -> str:
    code = frame.f_code
    return f"{getattr(code, 'co_qualname', code.co_name)} ({Path(code.co_filename).name}:{code.co_firstlineno})"


class ThreadSampler:
    """Sample every other thread's stack every ``interval`` seconds, from ``start()`` to ``stop()``."""

    def __init__(self, interval: float = 0.005):
        self.interval = float(interval)
        self.samples: collections.Counter = collections.Counter()  # "name [ident]" -> samples
        self.own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.cumulative: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self.seconds = 0.0

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                # the ident too: threads may share a name (multiprocessing's QueueFeederThread, one a queue)
                name = f"{names.get(ident, 'thread')} [{ident}]"
                self.samples[name] += 1
                self.own[name][_function(frame)] += 1
                seen = set()
                while frame is not None:  # a recursive function counts once a sample
                    seen.add(_function(frame))
                    frame = frame.f_back
                self.cumulative[name].update(seen)

    def start(self) -> "ThreadSampler":
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._started

    def summary(self, top: int = 8) -> dict:
        """Per thread, most sampled first: its samples and its ``top`` functions by own share (%), for a JSON."""
        return {name: {"samples": count, "own_pct": {fn: round(100 * n / count, 1)
                                                     for fn, n in self.own[name].most_common(top)}}
                for name, count in self.samples.most_common()}

    def report(self, top: int = 30) -> str:
        """Per thread, most sampled first: its samples, then its functions by own and by cumulative share."""
        lines = [f"{sum(self.samples.values())} samples of {len(self.samples)} threads every "
                 f"{self.interval * 1e3:.0f} ms over {self.seconds:.2f} s; a thread's share of a function is the "
                 "share of its samples with that function on top (own) or anywhere on its stack (cumulative)", ""]
        for name, count in self.samples.most_common():
            lines.append(f"==== thread {name}: {count} samples (~{count * self.interval:.2f} s)")
            for label, counter in (("own", self.own[name]), ("cumulative", self.cumulative[name])):
                lines.append(f"  by {label}:")
                lines += [f"    {100 * n / count:5.1f} %  {fn}" for fn, n in counter.most_common(top)]
            lines.append("")
        return "\n".join(lines)


@contextlib.contextmanager
def sampled_threads(path: Path, interval: float = 0.005, top: int = 30):
    """Sample every thread of the process during the block (``ThreadSampler``) and write the report to ``path``."""
    sampler = ThreadSampler(interval).start()
    try:
        yield sampler
    finally:
        sampler.stop()
        Path(path).write_text(sampler.report(top))
