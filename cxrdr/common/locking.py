"""Advisory locks on output folders, so two writers never mix their files in one folder.

Hand-written on ``fcntl.flock`` (Linux/macOS) rather than a lock library: the kernel drops a
flock when its process dies (even by kill -9), so a crash never leaves a stale lock behind, and
a lock is held per open file, so the same process can test it too. Files:

- ``.cxrdr.lock``: the folder lock. Exclusive for one-process writers (`train run`,
  `reinforce merge`, `reinforce add-teacher`). The ranks of one multi-rank build share it; the
  first of them records its world size there so that a build with another world size cannot join.
- ``.cxrdr.rank-RRRRR.lock``: exclusive per build rank (two processes never build one rank).
- ``.cxrdr.plan.lock``: held briefly while a rank compares and writes ``stats/plan.json``, so two
  ranks cannot both find no plan and both write theirs.

Held by the locking process alone, never by its forked children (issue 38). A flock belongs to
the open file description, and ``fork()`` shares that description with the child: a DataLoader
worker of `train run` or `reinforce build` held the folder's lock too, and when the main process
was killed with SIGKILL the orphaned worker kept it until it noticed its parent was gone, so an
immediate ``--resume`` was refused. Measured (a holder forks a child, is killed with SIGKILL, and
a third process tries the lock while the child lives; tests/test_chaos.py does it for real):

- ``O_CLOEXEC`` (Python's default): acts on ``exec`` only; a forked worker still shares the lock.
- Linux OFD locks (``F_OFD_SETLK``): also owned by the open file description, so inherited by
  ``fork()`` exactly like a flock (measured: still held after the main process's SIGKILL).
- POSIX record locks (``F_SETLK``): not inherited, but owned by the process, so the same process
  could take its own folder's lock twice (the in-process busy check would pass), and closing *any*
  descriptor of the file, anywhere in the process, silently drops it.
- Spawned workers: would have to be imposed on every DataLoader of both stages (and cost each
  worker a fresh interpreter and torch import).

Chosen: flock, plus an ``os.register_at_fork(after_in_child=...)`` hook that closes, in every
forked child, the descriptors of the locks this process holds, before the child runs any code of
its own. Closing one of two descriptors of a description does not unlock it (the parent's copy
keeps it); once the parent dies its copy is the last, so the kernel drops the lock at once. The
child never calls ``LOCK_UN`` on its copy: that would unlock the parent's lock too. Exec'd
children (subprocess) never inherit the descriptor (``O_CLOEXEC``); forkserver and spawn children
are not forked from the holder. Only a fork made outside Python (C code calling ``fork()``
directly) would skip the hook.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
import weakref
from pathlib import Path

from cxrdr.common.errors import UserError

FOLDER_LOCK = ".cxrdr.lock"


class FolderBusyError(UserError):
    """Another process is writing the folder."""


# The lock files this process has open (weakly: a lock file dropped unreleased still closes, as before).
_OPEN_LOCK_FILES: "weakref.WeakSet" = weakref.WeakSet()


def _close_inherited_locks() -> None:
    """In a freshly forked child: close its copies of the parent's lock files (see the module
    docstring). Closing, not unlocking: the parent keeps its lock while it lives."""
    for fh in list(_OPEN_LOCK_FILES):
        try:
            fh.close()
        except (OSError, ValueError):  # a write buffer we never filled; already closed
            pass
    _OPEN_LOCK_FILES.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _open(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    _OPEN_LOCK_FILES.add(fh)
    return fh


def _try_flock(fh, mode: int) -> bool:
    try:
        fcntl.flock(fh.fileno(), mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


BRIEF_WAIT_S = 2.0


def _retry_flock(fh, mode: int, seconds: float = BRIEF_WAIT_S) -> bool:
    """Retry briefly: a rank that started first holds the lock exclusively for the moment it takes
    to record its world size, before it downgrades to shared (``join_wait``: longer where it is a rank)."""
    deadline = time.monotonic() + seconds
    while not _try_flock(fh, mode):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


# How long a rank waits for another rank of its build that is still starting: it holds the folder lock alone while
# it records its world size and removes a killed run's temp files (a walk of the folder, seconds on a shared one).
RANK_START_WAIT_S = 30.0


def join_wait(fh, world_size: int) -> float:
    """Seconds to wait for the folder lock: long where its holder is a rank of a build of this world size (still
    starting), the default's brief retry where it is any other writer (whose error should come at once)."""
    return RANK_START_WAIT_S if f"world size {world_size} " in _holder(fh) else BRIEF_WAIT_S


def _holder(fh) -> str:
    fh.seek(0)
    text = fh.read().strip()
    return text or "another process"


def _record(fh, text: str) -> None:
    fh.seek(0)
    fh.truncate()
    fh.write(text)
    fh.flush()


class FolderLock:
    """A held lock on ``folder``; ``alone`` is True when no other process held any lock on it
    when it was taken (then temp files left in the folder are stale: nobody is writing them)."""

    def __init__(self, folder: Path, files: list, alone: bool):
        self.folder, self._files, self.alone = Path(folder), files, alone

    def release(self) -> None:
        for fh in reversed(self._files):
            if fh.closed:  # a forked child's copy, closed at fork: LOCK_UN would unlock the parent
                continue
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()
        self._files = []

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(folder: str | os.PathLike, what: str) -> FolderLock:
    """Exclusive lock on ``folder`` for the command ``what``; FolderBusyError naming the holder."""
    folder = Path(folder)
    fh = _open(folder / FOLDER_LOCK)
    if not _try_flock(fh, fcntl.LOCK_EX):
        holder = _holder(fh)
        fh.close()
        raise FolderBusyError(f"{folder} is in use by {holder}; wait for it to finish (a second writer "
                              f"would mix its files into the same folder)")
    _record(fh, f"`{what}` (pid {os.getpid()})")
    return FolderLock(folder, [fh], alone=True)


def lock_build_rank(folder: str | os.PathLike, rank: int, world_size: int, what: str = "reinforce build") -> FolderLock:
    """Shared folder lock (ranks of one build run together) + exclusive lock of ``rank``."""
    folder = Path(folder)
    fh = _open(folder / FOLDER_LOCK)
    busy = (f"{folder} is in use by {{holder}}; wait for it to finish (a second writer would mix its "
            f"shards into the same folder)")
    alone = _try_flock(fh, fcntl.LOCK_EX)
    if alone:
        _record(fh, f"`{what}` with world size {world_size} (pid {os.getpid()})")
        # A killed run's temp files are stale only while no rank can have joined: removed before the downgrade
        # (after it, a rank that joined at once was writing its plan's temp file as this one removed it).
        remove_stale_temp_files(folder)
        # downgrade: other ranks may join (flock converts by unlocking first: a joiner may slip in, so wait)
        if not _retry_flock(fh, fcntl.LOCK_SH, join_wait(fh, world_size)):
            fh.close()
            raise FolderBusyError(f"{folder}: another writer took the folder as this rank started; rerun it")
    elif not _retry_flock(fh, fcntl.LOCK_SH, join_wait(fh, world_size)):
        holder = _holder(fh)
        fh.close()
        raise FolderBusyError(busy.format(holder=holder))
    else:
        holder = _holder(fh)
        if f"world size {world_size} " not in holder:
            fh.close()
            raise FolderBusyError(busy.format(holder=holder) + f"; this rank has world size {world_size}")
    rank_fh = _open(folder / f".cxrdr.rank-{rank:05d}.lock")
    if not _try_flock(rank_fh, fcntl.LOCK_EX):
        holder = _holder(rank_fh)
        rank_fh.close()
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()
        raise FolderBusyError(f"{folder}: rank {rank} is already being built by {holder}; wait for it "
                              f"to finish")
    _record(rank_fh, f"`{what}` rank {rank} (pid {os.getpid()})")
    return FolderLock(folder, [fh, rank_fh], alone=alone)


@contextlib.contextmanager
def plan_lock(folder: str | os.PathLike):
    """Briefly serialise ranks comparing/writing the build plan (blocking: it is held for ms)."""
    fh = _open(Path(folder) / ".cxrdr.plan.lock")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield
    finally:
        if not fh.closed:  # closed: this is a child forked inside the block (see release)
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()


def remove_stale_temp_files(folder: str | os.PathLike, patterns=("*.tmp[0-9]*", ".*.tmp[0-9]*")) -> list[Path]:
    """Delete temp files (``NAME.tmpPID``) a killed run left in ``folder`` and its subfolders.
    Call only while holding the folder lock *alone* (nobody else can be writing them)."""
    removed = []
    folder = Path(folder)
    for pattern in patterns:
        for path in folder.rglob(pattern):
            suffix = path.name.rsplit(".tmp", 1)[-1]
            if suffix.isdigit() and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed
