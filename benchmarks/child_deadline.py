"""Run one benchmark call in a child process and stop it at a deadline.

A compilation cannot be interrupted from its own process: on the H100 at 48c40d0 the suite's whole-model compiled E
ran past its section's budget until the command's own timeout killed the suite, twice (docs/gpu.md). In a child the
call can be killed at its deadline and the suite goes on with what it measured.

Why not the standard pools: ``multiprocessing.Pool``'s workers are daemonic, so the call could not start the
training loop's DataLoader workers; ``concurrent.futures.ProcessPoolExecutor`` cannot stop a running call before
Python 3.14. The child is started with "spawn": the parent may hold a CUDA context, which a forked child cannot use.

A call that will be killed first writes every thread's Python stack to stderr (``faulthandler``), shortly before its
deadline: on the H100 at 416dba0 the whole-model A and the block-by-block D compiled configurations were killed
without logging their first step, and nothing said where they were.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import time
import traceback


class DeadlineExceeded(TimeoutError):
    """The call had not returned at its deadline; its child process was killed."""


def _dump_margin(seconds: float) -> float:
    """How long before its deadline a call writes its stacks: a tenth of its time, 0.5 to 10 s."""
    return min(10.0, max(0.5, seconds / 10))


def _child(conn, fn, args, kwargs, dump_at: float) -> None:
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
    ``seconds`` (the child killed, after writing its threads' stacks to stderr ``_dump_margin`` before), or
    ``RuntimeError`` naming the child's exception or exit code. ``fn`` must be importable by the child (a
    module-level function). ``env``: variables set for the child only (e.g. TORCH_LOGS, read when torch is
    imported)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    dump_at = time.time() + seconds - _dump_margin(seconds)  # wall clock: the child's own start-up counts too
    process = ctx.Process(target=_child, args=(send, fn, args, kwargs, dump_at), name=f"deadline-{fn.__name__}")
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
            raise DeadlineExceeded(f"{fn.__name__} did not return within {seconds:.0f} s; its child process was "
                                   "killed")
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
