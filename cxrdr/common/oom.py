"""A batch that does not fit in GPU memory, said in one line (issue 38): the batch size, the
device's memory and the peak this process reached, and the flags that help. The command-line
modules catch it (``is_out_of_memory``) around the whole command and raise
``cxrdr.common.errors.OutOfDeviceMemory`` with the command's own advice; ``run_app`` prints it
and exits 1. Nothing is saved on the way out: what the command wrote before (a run's last
checkpoint, a build's complete shards) is what a ``--resume`` continues from, and writes are
atomic (temp file + rename), so a batch that failed left no half-written file.

torch is imported lazily (only when a command has already loaded it), so that the CLIs'
start-up stays cheap.
"""
from __future__ import annotations

import re
import sys

GIB = 1024**3
_TRIED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")


def is_out_of_memory(exc: BaseException) -> bool:
    """``exc`` is torch's out-of-memory error (CUDA's, or the device-generic one of newer torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    kinds = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError})
    return isinstance(exc, kinds)


def device_memory(device=None) -> dict | None:
    """Name, total bytes and this process's peak allocated/reserved bytes of the CUDA ``device``
    ('cuda:N'; None, 'auto' or 'cuda': the current one); None when CUDA was never initialised here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    if device not in (None, "auto", "cpu"):
        parsed = torch.device(device)
        if parsed.type == "cuda" and parsed.index is not None:
            index = parsed.index
    props = torch.cuda.get_device_properties(index)
    return {"device": f"cuda:{index}", "name": props.name, "total": int(props.total_memory),
            "peak_allocated": int(torch.cuda.max_memory_allocated(index)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(index))}


def memory_phrase(exc: BaseException, memory: dict | None) -> str:
    """'cuda:0 (NAME) has 79.1 GiB; peak 77.9 GiB allocated (78.4 GiB reserved) by this process, and
    2.00 GiB more asked for' (what the device and torch's message tell)."""
    tried = _TRIED.search(str(exc))
    asked = f", and {tried.group(1)} more asked for" if tried else ""
    if memory is None:
        return f"device memory and peak unknown (CUDA not initialised in this process){asked}"
    return (f"{memory['device']} ({memory['name']}) has {memory['total'] / GIB:.1f} GiB; peak "
            f"{memory['peak_allocated'] / GIB:.1f} GiB allocated ({memory['peak_reserved'] / GIB:.1f} GiB "
            f"reserved) by this process{asked}")


def out_of_memory_line(what: str, exc: BaseException, device, advice: str) -> str:
    """The one line: 'out of GPU memory in WHAT: MEMORY; ADVICE' ('out of memory' when no CUDA device
    was in use: torch raises the same error for a host allocation that fails)."""
    memory = device_memory(device)
    return f"out of {'GPU ' if memory else ''}memory in {what}: {memory_phrase(exc, memory)}; {advice}"
