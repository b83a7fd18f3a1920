"""The ``kfac-bench`` subcommands, one module each.

A command module defines ``SUMMARY`` (its lines of ``kfac-bench --help``) and ``main(args) -> int`` (the
exit status; a :class:`kfac_bench.errors.UserError` it raises becomes one line and status 2). It imports
anything heavy inside ``main``, so ``kfac-bench --help`` stays fast. Adding a subcommand is a new module here
plus one line in :data:`COMMANDS`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["COMMANDS", "load"]

#: Subcommand name -> module in this package, in the order ``kfac-bench --help`` lists them.
COMMANDS: dict[str, str] = {
    "train": "train",
    "compare": "compare",
    "demo": "demo",
    "tune": "tune",
    "plan": "plan",
    "prepare-bert": "prepare_bert",
    "squad-eval": "squad_eval",
    "launch-scripts": "launch_scripts",
}


def load(name: str) -> ModuleType:
    """The module of subcommand ``name`` (a key of :data:`COMMANDS`)."""
    return importlib.import_module(f"{__name__}.{COMMANDS[name]}")
