"""`reinforce` command line: each command lives beside the code it drives.

The `reinforce` console script starts here, not in the composition root (cxrdr/cli.py), so a stage-1 command
imports neither stage 2 nor the experiments: `reinforce --help` took 6.8 s on a 2-core box through the root
(timm, torchvision's dynamo, open_clip), ~2 s from here."""
from __future__ import annotations

import functools

import typer

from cxrdr.common.allocator import keep_freed_memory
from cxrdr.common.errors import OutOfDeviceMemory, run_app, stacks_on_sigterm
from cxrdr.common.oom import is_out_of_memory, out_of_memory_line
from cxrdr.reinforce import add_teacher, build_cli, inspect, manifest, phantom, verify
from cxrdr.reinforce.captions import cli as captions_cli

app = typer.Typer(
    help="Stage 1 of cxrdr: turn image/report pairs into reinforced WebDataset shards "
         "(replayable augmentations, synthetic captions, teacher-ensemble embeddings).",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


def _teacher_oom_guard(command, what: str, rerun: str):
    """``command`` with a teacher batch that does not fit in GPU memory said in one line (exit 1):
    the --batch-size, the device's memory and peak, and how to go on (``rerun``). Typer reads the
    wrapped command's signature (``functools.wraps``)."""

    @functools.wraps(command)
    def guarded(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise OutOfDeviceMemory(out_of_memory_line(
                f"{what} at --batch-size {kwargs.get('batch_size')}", exc, kwargs.get("device"), rerun)) from exc

    return guarded


app.command("phantom")(phantom.cli_phantom)
app.command("captions")(captions_cli.cli_captions)
app.command("build")(_teacher_oom_guard(
    build_cli.cli_build, "a teacher batch of `reinforce build`",
    "complete shards are kept: rerun with --resume and a smaller --batch-size (records per teacher batch)"))
app.command("merge")(manifest.cli_merge)
app.command("add-teacher")(_teacher_oom_guard(
    add_teacher.cli_add_teacher, "a teacher batch of `reinforce add-teacher`",
    "shards already rewritten keep the new teacher: rerun the same command with a smaller --batch-size"))
app.command("inspect")(inspect.cli_inspect)
app.command("verify")(verify.cli_verify)


def main() -> None:
    stacks_on_sigterm()
    keep_freed_memory()
    run_app(app)


if __name__ == "__main__":
    main()
