"""Seeding and the RNG state a checkpoint keeps per rank (python, numpy, torch, CUDA)."""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict:
    # Tensors and plain types only (checkpoints are read with weights_only=True).
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if hasattr(keys, "numpy") else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(state["cuda"])
        except (RuntimeError, ValueError):  # different GPU count on resume: keep fresh CUDA RNG
            pass


@contextlib.contextmanager
def preserved_rng():
    """Run a block (a validation pass) without moving the process's RNGs: whatever it draws, or a
    library it imports on first use draws (sklearn draws from ``random`` on import), the training
    trajectory is the same with or without it, and wherever a resumed run restarts."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
