"""`train` command line: each command lives beside the code it drives."""
from __future__ import annotations

import typer

from cxrdr.common.errors import run_app

app = typer.Typer(
    help="Stage 2 of cxrdr: train the Patch-IB student from reinforced shards, evaluate it, "
         "and run the efficiency/ablation experiments.",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


def _register() -> None:
    from cxrdr.train import export, loop
    from cxrdr.train.evaluation import cli as eval_cli

    app.command("run")(loop.cli_run)
    app.command("eval")(eval_cli.cli_eval)
    app.command("export")(export.cli_export)


_register()


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
