"""Seconds of each phase of a piece of work, for the record it writes (where its time went)."""
from __future__ import annotations

import time


class PhaseClock:
    """``lap(name)`` closes the phase that just ran; ``seconds`` maps each phase to its wall seconds, in order."""

    def __init__(self, digits: int = 3):
        self.digits = digits
        self.started = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self._last = round(now - self._last, self.digits), now

    def total(self) -> float:
        return round(time.perf_counter() - self.started, self.digits)
