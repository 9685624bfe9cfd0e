"""Placeholder replaced by the workflow driver (issue 6)."""
from __future__ import annotations


def run_recipe(recipe, plan, out=None, resume=None, quiet=False, cluster="embedded"):
    from ..cli._common import CLIError

    raise CLIError("training is not implemented yet in this build (see issue 6); use `--dry-run` or `rlrecipes plan`")
