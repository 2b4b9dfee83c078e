"""Losses run in float32: similarity matrices and log-softmaxes lose too much in bf16/fp16."""
from __future__ import annotations

import contextlib
import functools

import torch


def full_precision(fn):
    """Run ``fn`` outside autocast (any device on which autocast is on)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for device in ("cuda", "cpu"):
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device_type=device, enabled=False))
            return fn(*args, **kwargs)

    return wrapper
