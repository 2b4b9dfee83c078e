"""Turn expected user errors into one-line messages instead of tracebacks (both CLIs use this); on request, a
SIGTERM prints where the process was first (`stacks_on_sigterm`)."""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys

import typer

from cxrdr.common.oom import is_out_of_memory, out_of_memory_line


class UserError(Exception):
    """Bad input from the user (path, spec, flag value): printed as one line, exit code 2."""


class OutOfDeviceMemory(Exception):
    """A batch did not fit in the accelerator's memory (``cxrdr.common.oom``): the input is fine, the
    settings are too big for the device; printed as one line naming them and the flags that help,
    exit code 1, no traceback (it would only show where the allocation failed)."""


# "package.module.SomeError: " at the start of a traceback's last line
_EXC_PREFIX = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit): ")


def one_line(message) -> str:
    """An error message as one line. An exception re-raised from a DataLoader worker carries the
    worker's whole traceback in its message: keep its last line (the original error's message)."""
    text = str(message).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) <= 1:
        return text
    if "Traceback (most recent call last)" in text:
        return _EXC_PREFIX.sub("", lines[-1], count=1)
    return " ".join(lines)


def run_app(app: typer.Typer) -> None:
    """Run a typer app; every error becomes one red line on stderr (a traceback with CXRDR_DEBUG=1).
    Expected errors (bad input) exit 2; anything else exits 1 and says how to see the traceback."""
    try:
        app(standalone_mode=True)
    except (UserError, FileNotFoundError, ValueError, KeyError) as exc:
        if os.environ.get("CXRDR_DEBUG"):
            raise
        name = type(exc).__name__
        message = one_line(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
        typer.secho(f"error: {message}" if isinstance(exc, UserError) else f"error ({name}): {message}",
                    fg=typer.colors.RED, err=True)
        sys.exit(2)
    except OutOfDeviceMemory as exc:
        if os.environ.get("CXRDR_DEBUG"):
            raise
        typer.secho(f"error: {one_line(exc)}", fg=typer.colors.RED, err=True)
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - an unexpected error still gets one line, not a traceback
        if os.environ.get("CXRDR_DEBUG"):
            raise
        if is_out_of_memory(exc):  # a command without advice of its own (train eval, experiments)
            typer.secho("error: " + out_of_memory_line("this command", exc, None, "try a smaller --batch-size"),
                        fg=typer.colors.RED, err=True)
            sys.exit(1)
        typer.secho(f"error ({type(exc).__name__}): {one_line(exc)} (set CXRDR_DEBUG=1 for the traceback)",
                    fg=typer.colors.RED, err=True)
        sys.exit(1)


def stacks_on_sigterm() -> None:
    """With CXRDR_STACKS_ON_TERM set, a SIGTERM (a chunk's ``timeout``) first prints every thread's stack to stderr,
    so a unit that outlasted its chunk says where it was (scripts/gpu-experiment.sh sets it). The main process
    only: forked loader workers drop the handler."""
    if os.environ.get("CXRDR_STACKS_ON_TERM"):
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))
