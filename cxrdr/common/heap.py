"""Keep Python's cyclic garbage collector off the objects a loop keeps for its whole length.

A collection of the oldest generation walks every tracked object in the process: the imported modules of
torch, transformers and timm, the model, its optimiser, the shard index. One such walk took 283 ms of a
tiny student's training on the 2-core box (464,000 objects; about once per 300 steps at batch 64, more
often at larger batches, whose collated samples are Python objects), and 290 ms with eight trainers alive,
as the GPU suite's loop section keeps them. A step bound by the host, as token dropping's (E) is on a GPU,
loses the whole pause. ``gc.freeze`` moves the objects alive when the loop starts to a permanent generation
that collections skip; objects made later are collected as before, and the frozen ones return to the
collector when the loop ends. Loader workers forked inside the loop inherit the frozen heap, so their own
collections do not copy its pages either (the build does the same: ``cpu_policy.cpu_settings``).
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # frozen_heap blocks open in this process


@contextlib.contextmanager
def frozen_heap():
    """Freeze the objects alive now for the block's duration; the outermost block unfreezes (everything: ``gc`` has
    no partial unfreeze). No collection first: a cycle already dead stays frozen until the block ends, and is
    collected after it. The nesting is counted here, not read from ``gc.get_freeze_count()``: Python 3.12.1 counts
    375 objects as frozen after every collection with none frozen, so a count of 0 does not mean "no block is
    open", and a loop's heap there was never given back (its cycles that died later never collected)."""
    global _depth
    entered = False
    try:
        with _lock:
            _depth += 1
            entered = True
            gc.freeze()
        yield
    finally:
        if entered:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    gc.unfreeze()
