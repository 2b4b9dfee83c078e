"""`python -m cxrdr.train.cli|reinforce.cli ...` processes forked from a server that imported cxrdr once.

A fresh interpreter spends seconds of CPU importing torch, open_clip and cxrdr before a command's
first line of work; the kill-and-resume and fault tests start about twenty such processes. These are
forked instead from a multiprocessing forkserver that preloaded those modules: each is still a process
of its own (its own environment, working folder, output and process group, ended by SIGKILL as a
preemption ends it, loader workers included) running the module as ``python -m`` runs it, only
without the imports.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the train and reinforce CLIs import (not the CLI modules themselves: runpy runs those afresh
# as __main__).
PRELOAD = ["torch", "open_clip", "cxrdr.train.config", "cxrdr.train.distributed", "cxrdr.train.loop",
           "cxrdr.train.export", "cxrdr.train.evaluation.cli", "cxrdr.train.models.factory",
           "cxrdr.reinforce.build_cli", "cxrdr.reinforce.build", "cxrdr.reinforce.add_teacher",
           "cxrdr.reinforce.inspect", "cxrdr.reinforce.manifest", "cxrdr.reinforce.phantom", "cxrdr.reinforce.verify",
           "cxrdr.reinforce.captions.cli", "cxrdr.teachers.random_tiny"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        # The server's OpenMP reads OMP_NUM_THREADS when torch loads; its children set theirs anyway.
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
    return _context


def _main(module: str, args: list[str], env: dict, cwd: str, stdout: str, stderr: str, group: int) -> None:
    """``python -m module args`` in this (forked) process: its group, environment, folder and output."""
    os.setpgid(0, group)
    multiprocessing.set_start_method(None, force=True)  # the platform's default again, not the forkserver
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException:  # as the interpreter ends on an uncaught exception: its traceback, exit status 1
        sys.excepthook(*sys.exc_info())
        sys.exit(1)
    finally:
        atexit._run_exitfuncs()  # the forkserver's child ends with os._exit


class CliProcess:
    """What the tests use of subprocess.Popen: pid, poll(), wait(), returncode, communicate() (text)."""

    def __init__(self, module: str, args: list[str], env: dict, cwd: Path, group: int = 0):
        self._out = [tempfile.NamedTemporaryFile(prefix="forked-cli-", suffix=f".{name}", delete=False).name
                     for name in ("stdout", "stderr")]
        self._proc = _forkserver().Process(target=_main, args=(module, list(args), dict(env), str(cwd), *self._out,
                                                               group))
        self._proc.start()
        self.pid = self._proc.pid
        deadline = time.monotonic() + 30
        while self._group() != (group or self.pid):  # in its group before anyone signals it
            if not self._proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{module} {args}: never joined process group {group or self.pid}: "
                                   + self.communicate(1)[1][-3000:])
            time.sleep(0.001)

    def _group(self) -> int | None:
        try:
            return os.getpgid(self.pid)
        except ProcessLookupError:
            return None

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode

    def stderr_so_far(self) -> str:
        """What the process has written to stderr up to now (it may still be running)."""
        return Path(self._out[1]).read_text(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return tuple(Path(path).read_text(errors="replace") for path in self._out)

    def __del__(self):
        for path in self._out:
            try:
                os.unlink(path)
            except (OSError, TypeError):  # gone already, or the interpreter is shutting down
                pass


def python_m(cmd: list[str], env: dict, cwd: Path, group: int = 0) -> CliProcess:
    """``cmd`` as given to Popen (``[python, "-m", module, *args]``), forked instead."""
    assert cmd[1] == "-m", cmd
    return CliProcess(cmd[2], cmd[3:], env, cwd, group)


def run(module: str, args: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, "-m", module, *args], capture_output=True, text=True, ...)`` gives."""
    proc = CliProcess(module, args, env, cwd)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess([module, *args], proc.returncode, out, err)
