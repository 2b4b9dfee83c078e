"""A frozen module's outputs remembered by the exact bytes of each input row (``RowMemo``).

A reinforced run replays the K augmentations stored per image (MobileCLIP's dataset reinforcement),
so over many epochs a frozen stem is fed the same few thousand views again and again: the CPU
demo's cpu-D student sees 12,800 views of 1,964 distinct ones in its 400 steps, and its frozen
Lite0 stem costs ~58 ms of a ~450 ms step on two cores. The memo runs the stem only on the rows it
has not seen and returns the stored outputs of the others. The EfficientNet towers' frozen stages
(``freeze_stages``: tiny-cnn-*, the CPU efficiency and reinforcement experiments' students) have one too.

It changes no bit: with a memo the frozen layers take their rows 16 at a time (``in_chunks``), so a row's
output never depends on the rest of its batch and a remembered row is the one they would compute again
(tests/test_frozen_memo.py checks that, and that a training run logs the same numbers with and without
the memo: on this CPU 16-row calls round as whole batches of 16 or more do). A key is a row's whole byte
content (BLAKE2b, with its shape and dtype), never an id that two different views could share. The memo
forgets everything when the weights change (another tensor, or one written in place: ``Tensor._version``)
or autocast does.

CPU only (the towers skip it elsewhere): hashing a CUDA row would read it back to the host, a
sync per step. Not under ``torch.compile`` (the Python hashing would break the graph). Not in plain runs:
their online augmentation never repeats a view, so a memo would only hash (the demo's tiny-cnn-A teacher:
0 hits in 2,612 rows, 147-149 -> 156-160 ms a step), and the training loop gives them none. Timings of the
model's own compute (``efficiency_metrics``) run with it ``suspended``.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from functools import partial

import torch
import torch.nn as nn


class RowMemo:
    """Least-recently-used outputs of a row-wise pure function, up to ``max_bytes`` of them."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self._context: tuple | None = None

    def clear(self) -> None:
        self.rows.clear()
        self.bytes = 0

    def __call__(self, fn, x: torch.Tensor, context: tuple) -> torch.Tensor:
        """``fn(x)``, computed for the rows of ``x`` not remembered under ``context`` (what else decides the
        output: the weights, the autocast state)."""
        if context != self._context:
            self.clear()
            self._context = context
        keys = self._keys(x)
        found = [self.rows.get(key) for key in keys]
        missing = [i for i, row in enumerate(found) if row is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if len(missing) == len(keys):
            out = fn(x)
            self._remember(keys, out)
            return out
        for key, row in zip(keys, found):
            if row is not None:
                self.rows.move_to_end(key)
        if missing:
            computed = fn(x[missing])
            self._remember([keys[i] for i in missing], computed)
            rows = iter(computed)
            found = [row if row is not None else next(rows) for row in found]
        return torch.stack(found)

    @staticmethod
    def _keys(x: torch.Tensor) -> list[bytes]:
        flat = x.detach().contiguous().reshape(len(x), -1).view(torch.uint8).numpy()
        header = f"{tuple(x.shape[1:])}:{x.dtype}".encode()
        return [hashlib.blake2b(memoryview(row), digest_size=16).digest() + header
                for row in flat]

    def _remember(self, keys: list[bytes], out: torch.Tensor) -> None:
        for key, row in zip(keys, out):
            row = row.clone()  # its own storage: a view would keep the whole batch alive
            if key not in self.rows:
                self.bytes += row.nbytes
            self.rows[key] = row
        while self.bytes > self.max_bytes and self.rows:
            self.bytes -= self.rows.popitem(last=False)[1].nbytes

    def describe(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "rows": len(self.rows),
                "mb": round(self.bytes / 2**20, 1), "max_mb": round(self.max_bytes / 2**20, 1)}


# Rows per call of frozen layers with a memo. A row's output can depend on how many rows its call holds (oneDNN picks
# kernels by batch size: on one thread, calls of 1-15 rows round differently from calls of 16 or more), so every call
# holds exactly this many (the last padded with copies of a row): a remembered row is then the one a later batch
# would compute, and a resumed run, its memo empty, computes what the run it continues remembered. 16 rows a call
# round as the whole batch of 16 or more without a memo did here (tests/test_frozen_memo.py).
CPU_CHUNK_ROWS = 16


def in_chunks(fn, x: torch.Tensor, rows: int = CPU_CHUNK_ROWS) -> torch.Tensor:
    """``fn`` (row-wise) on ``x`` in calls of exactly ``rows`` rows: the same outputs whatever the batch."""
    n = len(x)
    if n % rows:
        x = torch.cat([x, x[-1:].expand(rows - n % rows, *x.shape[1:])])
    return torch.cat([fn(part) for part in x.split(rows)])[:n]


def memo_applies(memo: RowMemo | None, x: torch.Tensor) -> bool:
    """Whether a frozen module runs ``x`` through its memo: one is set, on the CPU, outside ``torch.compile``."""
    return memo is not None and x.device.type == "cpu" and not torch.compiler.is_compiling()


def through_memo(memo: RowMemo, fn, x: torch.Tensor, *weights: nn.Module) -> torch.Tensor:
    """``fn(x)`` (the frozen layers of ``weights``) with ``memo``: the unseen rows 16 a call, the others remembered
    while those modules' weights and the autocast state stay as they were."""
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
    return memo(partial(in_chunks, fn), x, (weights_context(*weights), autocast))


def weights_context(*modules: nn.Module) -> tuple:
    """What identifies the modules' weights: each tensor's storage and its in-place write count."""
    return tuple((t.data_ptr(), t._version) for m in modules for t in (*m.parameters(), *m.buffers()))


def memo_modules(model: nn.Module) -> list[nn.Module]:
    """The modules under ``model`` that can remember their outputs (an ``output_memo`` attribute)."""
    return [m for m in model.modules() if hasattr(m, "output_memo")]


def enable_memos(model: nn.Module, max_mb: float) -> list[RowMemo]:
    """Give each frozen module under ``model`` a memo of ``max_mb`` MB (shared by none); returns them."""
    memos = []
    for module in memo_modules(model):
        module.output_memo = RowMemo(int(max_mb * 2**20))
        memos.append(module.output_memo)
    return memos


@contextlib.contextmanager
def suspended(model: nn.Module):
    """Inside: every memo under ``model`` is off (timings of the model's own compute; copies of the model)."""
    held = [(m, m.output_memo) for m in memo_modules(model)]
    for module, _ in held:
        module.output_memo = None
    try:
        yield
    finally:
        for module, memo in held:
            module.output_memo = memo
