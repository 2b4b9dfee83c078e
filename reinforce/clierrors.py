"""Turn expected user errors into one-line messages instead of tracebacks (both CLIs use this)."""
from __future__ import annotations

import os
import sys

import typer


class UserError(Exception):
    """Bad input from the user (path, spec, flag value): printed as one line, exit code 2."""


def run_app(app: typer.Typer) -> None:
    try:
        app(standalone_mode=True)
    except (UserError, FileNotFoundError, ValueError, KeyError) as exc:
        if os.environ.get("CXRDR_DEBUG"):
            raise
        name = type(exc).__name__
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        typer.secho(f"error: {message}" if isinstance(exc, UserError) else f"error ({name}): {message}",
                    fg=typer.colors.RED, err=True)
        sys.exit(2)
