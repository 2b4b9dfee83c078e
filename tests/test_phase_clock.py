"""PhaseClock: each phase's wall seconds, summed over its laps (add-teacher laps a phase once a batch)."""
from __future__ import annotations

import time

from cxrdr.common.phase_clock import PhaseClock


def test_a_phase_lapped_again_sums_and_skipped_time_counts_for_none():
    clock = PhaseClock(digits=3)
    for _ in range(2):
        time.sleep(0.02)
        clock.lap("read")
        time.sleep(0.05)
        clock.skip()  # counts for no phase
        time.sleep(0.01)
        clock.lap("write")
    seconds = clock.seconds
    assert list(seconds) == ["read", "write"]  # in the order first lapped
    assert 0.04 <= seconds["read"] < 0.09 and 0.02 <= seconds["write"] < 0.07
    assert clock.total() >= sum(seconds.values()) + 0.1  # the skipped 2 x 0.05 s is in the total only
