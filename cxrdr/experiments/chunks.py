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

Two rules keep a lease's work from being lost at its end (a lease's finished runs travel to the next one only
once evaluated, cxrdr/experiments/carry.py; a trained run without its evaluation is lost with the machine's disk):
a run's evaluation right after this command trained it is never stopped (``follows_on``), and with
``--chunk-hard-s`` (when the caller kills the command) a run whose training and evaluation would outlast the kill,
by this command's own measured step and evaluation times (:func:`expected_training_s`), does not start. Step
times are kept per kind of run (its model, batch and online teacher): a 120-step teacher's start-up spread over few
steps once made a 400-step student look 2x its cost, and the run it refused would have fitted (a lease lost ~110 s
of one copy).
"""
from __future__ import annotations

import os
import sys
import time


class ChunkTimeUp(Exception):
    """The chunk's time is up before ``unit`` started; rerun the command to continue there."""

    def __init__(self, unit: str, units_done: int, why: str = ""):
        super().__init__(f"chunk time up after {units_done} unit(s), before: {unit}{why}")
        self.unit, self.units_done = unit, units_done


# A training unit's expected seconds are this command's slowest measured per-step time for runs of its kind
# (start-up, validation passes and saves included) times its steps, times this margin for the other copy's load
# and the spread of a shared GPU, plus the slowest evaluation; the GPU recipe's runs of one lease varied by ~20 %
# (docs/gpu.md).
EXPECTED_MARGIN = 1.25


class _Clock:
    started: float | None = None  # when this command's chunk started
    deadline: float | None = None
    hard: float | None = None  # when the caller kills the command (--chunk-hard-s)
    units = 0
    per_step_s: dict[str, float] = {}  # kind of run -> the slowest training second per step this command measured
    evaluation_s: float | None = None  # and its slowest evaluation


_CLOCK = _Clock()


def start_chunk(seconds: float | None, hard_seconds: float | None = None) -> None:
    """Start this command's chunk: :func:`begin` stops new units after ``seconds`` (None: never), and a unit
    expected to run past ``hard_seconds`` (when the caller kills the command; None: not known) does not start."""
    now = time.monotonic()
    _CLOCK.started = None if seconds is None else now
    _CLOCK.deadline = None if seconds is None else now + float(seconds)
    _CLOCK.hard = None if seconds is None or hard_seconds is None else now + float(hard_seconds)
    _CLOCK.units = 0
    _CLOCK.per_step_s, _CLOCK.evaluation_s = {}, None


def begin(unit: str, expected_s: float | None = None, follows_on: bool = False) -> None:
    """A unit of work is about to start: raise ChunkTimeUp when this command already did a unit and the chunk's
    time is up, or the unit is expected to take ``expected_s`` seconds and would outlast the hard limit; else
    count it. ``follows_on``: the unit completes the one this command just did (a run's evaluation after its
    training), and is never stopped."""
    if _CLOCK.deadline is not None and _CLOCK.units and not follows_on:
        now = time.monotonic()
        if now >= _CLOCK.deadline:
            raise ChunkTimeUp(unit, _CLOCK.units)
        if expected_s is not None and _CLOCK.hard is not None and now + expected_s > _CLOCK.hard:
            raise ChunkTimeUp(unit, _CLOCK.units, f" (expected to take {expected_s:.0f} s, "
                                                  f"{_CLOCK.hard - now:.0f} s left before the command is killed)")
    _CLOCK.units += 1
    if _CLOCK.started is not None:
        # a chunk's timeline in the lease's log: each unit's start, by copy (process id), from the chunk's start;
        # the gaps between them less the units' measured work are what a lease loses to start-up between units
        print(f"[chunk {os.getpid()} +{time.monotonic() - _CLOCK.started:.1f} s] {unit}", file=sys.stderr, flush=True)


def measured_training(seconds: float, steps: int, kind: str) -> None:
    """A run of ``kind`` (what its step time depends on: ``runs.step_kind``) this command trained took ``seconds``
    for ``steps`` steps."""
    if steps > 0:
        _CLOCK.per_step_s[kind] = max(_CLOCK.per_step_s.get(kind, 0.0), seconds / steps)


def measured_evaluation(seconds: float) -> None:
    _CLOCK.evaluation_s = max(_CLOCK.evaluation_s or 0.0, seconds)


def expected_training_s(steps: int, kind: str) -> float | None:
    """Seconds a run of ``kind`` and ``steps`` steps and its evaluation are expected to take, by what this command
    measured (None before it trained a run of that kind)."""
    if kind not in _CLOCK.per_step_s:
        return None
    return EXPECTED_MARGIN * _CLOCK.per_step_s[kind] * steps + (_CLOCK.evaluation_s or 0.0)
