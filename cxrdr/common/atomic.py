"""Files written whole or not at all: a temp file beside the target, then a rename over it.

A process killed while writing (a lease's timeout, SIGKILL, a full disk) leaves the previous file, or none, and a
``NAME.tmpPID`` that the folder's next lock holder removes (``locking.remove_stale_temp_files``); readers never see
half a file. Both stages and the experiments mark work as done by such files (a shard's stats, a run's
summary.json, an evaluation's eval.json), so a torn one would read as done and then fail to parse.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator


def temp_path(path: str | os.PathLike) -> Path:
    """``NAME.tmpPID`` beside ``path``: the name ``remove_stale_temp_files`` clears after a killed process."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path beside ``path`` to write; renamed over ``path`` when the block ends, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole. ``fsync``: also on the disk before the rename (what a machine's
    crash, not only the process's, must not tear: the build's records)."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())


def write_json_atomic(path: str | os.PathLike, data, indent: int | None = 1, default=None, fsync: bool = True,
                      trailing_newline: bool = False) -> None:
    """``data`` as JSON to ``path`` whole (``json.dumps``' ``indent`` and ``default``)."""
    text = json.dumps(data, indent=indent, default=default) + ("\n" if trailing_newline else "")
    write_text_atomic(path, text, fsync=fsync)


def copy_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy ``src`` to ``dst`` whole (a checkpoint copied as another's name)."""
    with replacing(dst) as tmp:
        shutil.copyfile(src, tmp)
