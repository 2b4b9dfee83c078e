"""Where a recipe lease's copy time went: each unit's wall from a chunk's timeline against its own measured work.

    python benchmarks/lease_timeline.py benchmarks/results/profiles/<lease>-recipe-call1.log

A chunked command prints ``[chunk PID +T s] UNIT`` as each unit starts (``cxrdr.experiments.chunks.begin``), and the
lease's status listing gives each finished unit's measured work (``done  <unit>  <seconds> s``). A unit's wall is
from its start to the next unit's start in the same process (the last: to its chunk's exit, the slowest copy's,
``[gpu-experiment] chunk exited RC after N s``, whose clock starts before the process's imports: a few seconds
more); its gap, wall less measured work, is what no unit's own figure
shows (start-up, graph capture, saves outside the timed laps, the loader's start, waiting). Prints one row a unit
and each copy's totals; a unit with no measured work in the log (cut by the kill, or reused) shows its wall only.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TIMELINE = re.compile(r"^\[chunk (\d+) \+([\d.]+) s\] (.+)$")
CHUNK_START = re.compile(r"^\[gpu-experiment\] next chunk")
CHUNK_EXIT = re.compile(r"^\[gpu-experiment\] chunk exited -?\d+ after (\d+) s")
DONE = re.compile(r"^\s+done\s+(.+?)\s{2,}([\d.]+) s\b")


class Unit:
    """One unit of a chunk: its process, start (seconds from the chunk's start), name and end once known."""

    def __init__(self, pid: int, start: float, name: str):
        self.pid, self.start, self.name = pid, start, name
        self.end: float | None = None

    @property
    def wall(self) -> float | None:
        return None if self.end is None else self.end - self.start


def status_label(unit: str) -> str:
    """The status listing's name of a timeline unit (``cxrdr.experiments.status``): 'plain seed 10: training'."""
    verb, _, rest = unit.partition(" ")
    if verb == "step":
        return "step benchmark, results.json, table.md, plots"
    if verb == "add-teacher":
        return f"teacher {rest.split()[0]}: added to the students' shards"
    if verb == "evaluate" and rest.startswith("teacher "):
        path, _, tag = rest[len("teacher "):].rpartition(" on ")
        return f"teacher {Path(path).parent.name}: evaluation on {tag}"
    path = Path(rest)
    if verb == "build":
        if path.name == "report-shards":
            return "report set"
        return f"teacher {path.parent.name}: its shards" if path.parent.parent.name == "teachers" else \
            "students' shards"
    if path.name == "run" and path.parent.parent.name == "teachers":
        return f"teacher {path.parent.name}: training"
    seed = path.name.removeprefix("seed-")
    return f"{path.parent.name} seed {seed}: {'evaluation' if verb == 'evaluate' else 'training'}"


def read_log(text: str) -> tuple[list[Unit], dict[str, float]]:
    """(the units in their order, with their ends; the status listings' measured seconds by unit label)."""
    units: list[Unit] = []
    measured: dict[str, float] = {}
    chunk: list[Unit] = []
    for line in text.splitlines():
        if CHUNK_START.match(line):
            chunk = []
        elif m := TIMELINE.match(line):
            unit = Unit(int(m[1]), float(m[2]), m[3])
            earlier = [u for u in chunk if u.pid == unit.pid]
            if earlier:
                earlier[-1].end = unit.start
            chunk.append(unit)
            units.append(unit)
        elif m := CHUNK_EXIT.match(line):
            for last in {u.pid: u for u in chunk}.values():  # each process's last unit ends with the chunk
                last.end = max(last.end or 0.0, float(m[1]))
        elif m := DONE.match(line):
            measured[m[1].strip()] = float(m[2])
    return units, measured


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def table(units: list[Unit], measured: dict[str, float]) -> list[str]:
    rows = [f"{'pid':>7} {'start s':>8} {'wall s':>7} {'work s':>7} {'gap s':>6}  unit"]
    totals: dict[int, list[float]] = {}
    for u in units:
        work = measured.get(status_label(u.name))
        gap = None if u.wall is None or work is None else u.wall - work
        rows.append(f"{u.pid:>7} {u.start:>8.1f} {_fmt(u.wall):>7} {_fmt(work):>7} {_fmt(gap):>6}  {u.name}")
        if gap is not None:
            t = totals.setdefault(u.pid, [0.0, 0.0, 0.0])
            t[0], t[1], t[2] = t[0] + u.wall, t[1] + work, t[2] + gap
    for pid, (wall, work, gap) in totals.items():
        rows.append(f"copy {pid}: {wall:.1f} s of units with measured work, {work:.1f} s of it their work, "
                    f"{gap:.1f} s ({100 * gap / wall if wall else 0:.0f} %) outside it")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="a recipe lease's lease.log")
    args = parser.parse_args(argv)
    units, measured = read_log(args.log.read_text(errors="replace"))
    if not units:
        print(f"{args.log}: no chunk timeline ('[chunk PID +T s] UNIT' lines: stop 64 and later)", file=sys.stderr)
        return 2
    print("\n".join(table(units, measured)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
