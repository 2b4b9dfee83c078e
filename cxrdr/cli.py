"""Console entry point `train`: the composition root.

Stage 1 (`reinforce`) and stage 2 (`train`) never import each other; the experiments
(`cxrdr.experiments`) drive both, so `train experiment` is attached here rather than in stage 2.
The `reinforce` console script is stage 1's own (``cxrdr.reinforce.cli:main``): it needs nothing of the rest.
"""
from __future__ import annotations

from cxrdr.common.allocator import keep_freed_memory
from cxrdr.common.errors import run_app, stacks_on_sigterm
from cxrdr.experiments.cli import cli_experiment
from cxrdr.reinforce.cli import app as reinforce_app, main as reinforce_main  # noqa: F401 - the former entry point
from cxrdr.train.cli import app as train_app

train_app.command("experiment")(cli_experiment)


def train_main() -> None:
    stacks_on_sigterm()
    keep_freed_memory()
    run_app(train_app)


if __name__ == "__main__":
    train_main()
