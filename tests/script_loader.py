"""Load a repository script or benchmark (not a package module) as a module, for tests that call its functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, name: str | None = None):
    """The module at ``path`` (relative to the repository root, or absolute), executed once per call."""
    path = Path(path)
    path = path if path.is_absolute() else REPO / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
