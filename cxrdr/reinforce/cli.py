"""`reinforce` command line: each command lives beside the code it drives."""
from __future__ import annotations

import typer

from cxrdr.common.errors import run_app
from cxrdr.reinforce import add_teacher, build_cli, inspect, manifest, phantom, verify
from cxrdr.reinforce.captions import cli as captions_cli

app = typer.Typer(
    help="Stage 1 of cxrdr: turn image/report pairs into reinforced WebDataset shards "
         "(replayable augmentations, synthetic captions, teacher-ensemble embeddings).",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


app.command("phantom")(phantom.cli_phantom)
app.command("captions")(captions_cli.cli_captions)
app.command("build")(build_cli.cli_build)
app.command("merge")(manifest.cli_merge)
app.command("add-teacher")(add_teacher.cli_add_teacher)
app.command("inspect")(inspect.cli_inspect)
app.command("verify")(verify.cli_verify)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
