"""A ``kfac-bench train`` command line split as Hydra splits it: its flags (with their values) and its
overrides, and the user's config directories among the flags (``--config-dir DIR``, ``--config-dir=DIR``,
``-cd DIR``). Shared by the CLI and by the multinode agent, which checks the same command line before it
starts the ranks (:mod:`kfac_bench.launcher.agent`)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CFG_CHOICES", "INFO_CHOICES", "config_dirs_of", "split_args"]

#: Hydra's flags that take the next argument as their value (``--cfg job`` as well as ``--cfg=job``), and
#: ``--info`` / ``-i``, whose value is optional: the next argument is its value only if it is one of these
#: choices (hydra/_internal/utils.py ``get_args_parser``, Hydra 1.3).
FLAGS_WITH_VALUE = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
}
FLAGS_WITH_OPTIONAL_VALUE = {"--info", "-i"}
INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
CFG_CHOICES = {"job", "hydra", "all"}


def split_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(flags with their values, overrides), as Hydra's own command-line parser splits them."""
    flags: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        flags.append(arg)
        takes_next = arg in FLAGS_WITH_VALUE or (
            arg in FLAGS_WITH_OPTIONAL_VALUE and i < len(args) and args[i] in INFO_CHOICES
        )
        if takes_next and i < len(args):
            flags.append(args[i])
            i += 1
    return flags, overrides


def config_dirs_of(flags: Sequence[str]) -> list[str]:
    """The directories of Hydra's ``--config-dir DIR`` / ``--config-dir=DIR`` / ``-cd DIR`` flags."""
    dirs = []
    for i, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name in ("--config-dir", "-cd"):
            if eq:
                dirs.append(value)
            elif i + 1 < len(flags):
                dirs.append(flags[i + 1])
    return dirs
