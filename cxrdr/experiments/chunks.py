"""Running an experiment in chunks of a few minutes (`train experiment ... --chunk-s N`).

A lent GPU runs commands of a few minutes each, so a recipe must finish through repeated commands. Every
unit of work is reused when done and resumed when interrupted: a shard build and add-teacher per shard, a
run from its last.pt (recipe key ``resume_runs``; without it an unfinished run restarts), an evaluation is
redone. So a command killed at any point loses at most a shard, the steps since the run's last save or one
evaluation.

``--chunk-s N`` also stops cleanly *between* units: the places where a unit's real work starts (not its
reuse) call :func:`begin`, which raises :class:`ChunkTimeUp` once N seconds have passed since the command
started. A command always does at least one unit, so every command makes progress whatever N is (0: one
unit per command). Without ``--chunk-s``, :func:`begin` never stops anything.
"""
from __future__ import annotations

import time


class ChunkTimeUp(Exception):
    """The chunk's time is up before ``unit`` started; rerun the command to continue there."""

    def __init__(self, unit: str, units_done: int):
        super().__init__(f"chunk time up after {units_done} unit(s), before: {unit}")
        self.unit, self.units_done = unit, units_done


class _Clock:
    deadline: float | None = None
    units = 0


_CLOCK = _Clock()


def start_chunk(seconds: float | None) -> None:
    """Start this command's chunk: :func:`begin` stops new units after ``seconds`` (None: never)."""
    _CLOCK.deadline = None if seconds is None else time.monotonic() + float(seconds)
    _CLOCK.units = 0


def begin(unit: str) -> None:
    """A unit of work is about to start: raise ChunkTimeUp when the chunk's time is up and this command
    already did a unit; else count it."""
    if _CLOCK.deadline is not None and _CLOCK.units and time.monotonic() >= _CLOCK.deadline:
        raise ChunkTimeUp(unit, _CLOCK.units)
    _CLOCK.units += 1
