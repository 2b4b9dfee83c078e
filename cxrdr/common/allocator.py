"""Keep freed large buffers inside the process (glibc): CPU training steps fault far less.

glibc hands every freed block above its mmap threshold (adaptive, at most 32 MiB) back to the operating
system, so the next step's allocation of the same size page-faults it in again, one 4 KiB page at a
time. A CPU training step allocates and frees many such activations; on the CPU ladder's frozen
EfficientNet stem, zero-filling one fresh 29 MB padding buffer and the BatchNorm after it took about
three quarters of the stem's time, and the stem ran 2x faster with the thresholds raised
(``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` do the same from the environment).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3


def keep_freed_memory(limit_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds to ``limit_bytes`` (falling back to 32 MiB, the largest
    mmap threshold some glibc versions accept). True when applied; False off glibc (nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for limit in (min(int(limit_bytes), 2**31 - 1), 32 << 20):  # a C int
        if mallopt(M_MMAP_THRESHOLD, limit) and mallopt(M_TRIM_THRESHOLD, limit):
            return True
    return False
