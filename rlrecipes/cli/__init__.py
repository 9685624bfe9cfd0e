"""The `rlrecipes` command line: one module per subcommand, each with examples in its --help."""
from __future__ import annotations

import typer

from . import check, cp, launch, ls, plan, report, run, show

app = typer.Typer(
    name="rlrecipes",
    help="RL training recipes (GRPO, DAPO, PPO) for LLMs on Ascend NPU clusters, runnable wherever PyTorch runs.\n\n"
         "Start with `rlrecipes list`, then `rlrecipes run qwen25_7b --smoke`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
for mod in (ls, show, cp, plan, run, launch, check, report):
    mod.register(app)


def main() -> None:  # console-script entry point
    from .. import interrupts

    interrupts.PROCESS_EXIT = True  # Ctrl-C while this process shuts down still exits 130 (interrupts.guard)
    app()
