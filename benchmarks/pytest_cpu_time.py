"""The CPU each test takes (a pytest plugin), and a summary of it: where the test suite's time goes.

    rm -rf /tmp/cxrdr-test-cpu
    PYTHONPATH=.:benchmarks python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p pytest_cpu_time
    python benchmarks/pytest_cpu_time.py            # totals, then the costliest tests and files

Each pytest process (every xdist worker) appends, per test, its own user+sys seconds, those of the children it
waited for, and the test's wall seconds to a file of its own in CXRDR_TEST_CPU_DIR (default /tmp/cxrdr-test-cpu;
the summary reads every file there, so empty the folder before a run). Not counted: processes a test does not wait
for (Ray's actors, the forkserver's children of the kill tests). Wall time moves ±20 s between identical runs on a
shared 2-core box; CPU seconds move less. Stop 59 measured the suite's CPU at 352 s, then 306 s.
"""
from __future__ import annotations

import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

FOLDER = Path(os.environ.get("CXRDR_TEST_CPU_DIR", "/tmp/cxrdr-test-cpu"))


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's hook signature)
    """One line per test: its node id, own CPU s, waited-for children's CPU s, wall s (setup to teardown)."""
    before, started = _cpu(), time.perf_counter()
    yield
    after = _cpu()
    FOLDER.mkdir(parents=True, exist_ok=True)
    with open(FOLDER / f"cpu-{os.getpid()}.tsv", "a") as out:
        out.write(f"{item.nodeid}\t{after[0] - before[0]:.2f}\t{after[1] - before[1]:.2f}\t"
                  f"{time.perf_counter() - started:.2f}\n")


def summary(folder: Path = FOLDER, top: int = 25) -> str:
    rows = [line.split("\t") for path in sorted(folder.glob("cpu-*.tsv")) for line in path.read_text().splitlines()]
    if not rows:
        return f"no test recorded in {folder} (run pytest with -p pytest_cpu_time first)"
    own, children = sum(float(r[1]) for r in rows), sum(float(r[2]) for r in rows)
    tests = Counter({r[0]: float(r[1]) + float(r[2]) for r in rows})
    files: Counter = Counter()
    for name, seconds in tests.items():
        files[name.split("::")[0]] += seconds
    lines = [f"{len(rows)} tests: CPU {own + children:.1f} s ({own:.1f} s in pytest's processes, {children:.1f} s "
             f"in the children they waited for); tests' wall seconds summed {sum(float(r[3]) for r in rows):.1f}"]
    lines += ["", "costliest tests (CPU s):"] + [f"{s:8.2f}  {n}" for n, s in tests.most_common(top)]
    lines += ["", "costliest files (CPU s):"] + [f"{s:8.2f}  {n}" for n, s in files.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]) if len(sys.argv) > 1 else FOLDER))
