"""Run one benchmark call in a child process and stop it at a deadline.

A compilation cannot be interrupted from its own process: on the H100 at 48c40d0 the suite's whole-model compiled E
ran past its section's budget until the command's own timeout killed the suite, twice (docs/gpu.md). In a child the
call can be killed at its deadline and the suite goes on with what it measured.

Why not the standard pools: ``multiprocessing.Pool``'s workers are daemonic, so the call could not start the
training loop's DataLoader workers; ``concurrent.futures.ProcessPoolExecutor`` cannot stop a running call before
Python 3.14. The child is started with "spawn": the parent may hold a CUDA context, which a forked child cannot use.

A call that will be killed first writes every thread's Python stack to stderr (``faulthandler``), shortly before its
deadline: on the H100 at 416dba0 the whole-model A and the block-by-block D compiled configurations were killed
without logging their first step, and nothing said where they were. At the deadline the parent also lists the
child's own processes (inductor's compile workers, the loader's workers) with their state and their share of a core
over one second, which tells a compilation still working from one that waits on something; then it kills the child
and those processes together (the child leads a process group of its own), so that nothing a killed configuration
started lives on beside the next one.

A spawned child's own default start method is "spawn" too (Python passes the parent's context on), so the loader
in it would spawn its workers, each importing torch and cxrdr before the next one starts: on the H200 at 65e9f61 the
whole-model A configuration spent its 180 s starting 14 loader workers and never reached its first compiled step.
The child therefore goes back to the parent's default start method (fork on Linux up to Python 3.13), as in the
suite's own process.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path


class DeadlineExceeded(TimeoutError):
    """The call had not returned at its deadline; its child process was killed. ``processes``: the child and its
    descendants as they were at the deadline (``process_tree``), for the caller's record."""

    def __init__(self, message: str, processes: list[dict] | None = None):
        super().__init__(message)
        self.processes = processes or []


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> dict | None:
    """State, parent and CPU seconds of one process from Linux's /proc (None where it is gone or there is no /proc).
    The command name sits in parentheses and may hold spaces, so the fields are read after its closing one."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    return {"pid": pid, "ppid": int(rest[1]), "state": rest[0], "name": name, "cmd": cmdline[:160],
            "cpu_s": (int(rest[11]) + int(rest[12])) / _TICKS}


def process_tree(root: int, interval: float = 1.0) -> list[dict]:
    """``root`` and every process below it, each with its /proc state (R running, S sleeping, D waiting on the
    disk, Z a zombie) and its share of one core over ``interval`` seconds (``busy``): a compilation that is slow
    keeps its workers busy, one that waits leaves them all idle. Empty where there is no /proc."""
    def snapshot() -> dict[int, dict]:
        try:
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return {}
        stats = {s["pid"]: s for s in map(_proc_stat, pids) if s is not None}
        tree, frontier = {}, [root]
        while frontier:
            pid = frontier.pop()
            if pid in stats and pid not in tree:
                tree[pid] = stats[pid]
                frontier += [s["pid"] for s in stats.values() if s["ppid"] == pid]
        return tree

    before = snapshot()
    time.sleep(interval if before else 0)
    after = snapshot()
    return [{**s, "busy": round((s["cpu_s"] - before[pid]["cpu_s"]) / interval, 2) if pid in before else None}
            for pid, s in sorted(after.items())]


def describe_processes(processes: list[dict]) -> str:
    """A line a process: pid, parent, state, share of a core, CPU seconds so far, command."""
    return "\n".join(f"  pid {p['pid']} (parent {p['ppid']}) {p['state']} busy {p['busy']} cpu {p['cpu_s']:.1f} s: "
                     f"{p['cmd'] or p['name']}" for p in processes)


def _kill_group(process) -> None:
    """SIGKILL the child's process group: the child and whatever it started, where the child leads its own group
    (never the caller's: a child that has not yet made its group is killed alone)."""
    try:
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, signal.SIGKILL)
            return
    except (OSError, AttributeError):  # gone already, or no process groups (Windows)
        pass
    process.kill()


def _dump_margin(seconds: float) -> float:
    """How long before its deadline a call writes its stacks: a tenth of its time, 0.5 to 10 s."""
    return min(10.0, max(0.5, seconds / 10))


def _child(conn, fn, args, kwargs, dump_at: float, start_method: str) -> None:
    multiprocessing.set_start_method(start_method, force=True)  # the parent's (module docstring), not "spawn"
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # a group of its own: at the deadline the parent kills it with what it started
    faulthandler.dump_traceback_later(max(0.1, dump_at - time.time()), file=sys.stderr)
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        faulthandler.cancel_dump_traceback_later()
        conn.close()


def call_with_deadline(fn, seconds: float, *args, env: dict | None = None, **kwargs):
    """``fn(*args, **kwargs)`` in a spawned child; its return value (picklable), or ``DeadlineExceeded`` after
    ``seconds`` (the child killed with the processes it started, after writing its threads' stacks to stderr
    ``_dump_margin`` before and, at the deadline, the parent's list of those processes), or
    ``RuntimeError`` naming the child's exception or exit code. ``fn`` must be importable by the child (a
    module-level function). ``env``: variables set for the child only (e.g. TORCH_LOGS, read when torch is
    imported)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    dump_at = time.time() + seconds - _dump_margin(seconds)  # wall clock: the child's own start-up counts too
    process = ctx.Process(target=_child, args=(send, fn, args, kwargs, dump_at, multiprocessing.get_start_method()),
                          name=f"deadline-{fn.__name__}")
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        process.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    send.close()  # the child holds the only sending end: its death ends the pipe
    try:
        if not receive.poll(seconds):
            processes = process_tree(process.pid)
            print(f"child_deadline: {fn.__name__}'s processes at its deadline of {seconds:.0f} s (busy: share of a "
                  f"core over the last second):\n{describe_processes(processes)}", file=sys.stderr, flush=True)
            _kill_group(process)
            raise DeadlineExceeded(f"{fn.__name__} did not return within {seconds:.0f} s; its child process was "
                                   "killed", processes)
        try:
            status, value = receive.recv()
        except EOFError:
            process.join(5)
            raise RuntimeError(f"{fn.__name__}: its child process ended without a result "
                               f"(exit code {process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"{fn.__name__} failed in its child process: {value}")
        return value
    finally:
        receive.close()
        if process.is_alive():
            process.terminate()
            process.join(10)
            if process.is_alive():
                process.kill()
        process.join()
