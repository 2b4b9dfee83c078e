"""Seconds of each phase of a piece of work, for the record it writes (where its time went)."""
from __future__ import annotations

import time


class PhaseClock:
    """``lap(name)`` closes the phase that just ran and adds its wall seconds to that phase's (a phase lapped again,
    e.g. once a batch, sums); ``skip()`` closes time that counts for no phase; ``seconds`` maps each phase to its
    seconds, in the order first lapped."""

    def __init__(self, digits: int = 3):
        self.digits = digits
        self.started = self._last = time.perf_counter()
        self._sums: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._sums[phase], self._last = self._sums.get(phase, 0.0) + now - self._last, now

    def skip(self) -> None:
        self._last = time.perf_counter()

    @property
    def seconds(self) -> dict[str, float]:
        return {phase: round(s, self.digits) for phase, s in self._sums.items()}

    def total(self) -> float:
        return round(time.perf_counter() - self.started, self.digits)
