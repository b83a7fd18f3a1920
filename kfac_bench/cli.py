"""``kfac-bench``: the command-line entry point. It only dispatches to the subcommand's module in
:mod:`kfac_bench.commands` and turns a :class:`kfac_bench.errors.UserError` into one line and exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kfac_bench.commands import COMMANDS, load
from kfac_bench.errors import ConfigError, UserError, visible

__all__ = ["main", "usage"]


def usage() -> str:
    """``kfac-bench --help``: every subcommand's summary."""
    lines = ["usage: kfac-bench <command> [args]   (kfac-bench --version)", "", "commands:"]
    lines += [load(name).SUMMARY.rstrip() for name in COMMANDS]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    if args[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"kfac-bench {version('kfac-bench')}")
        return 0
    command, rest = args[0], args[1:]
    try:
        if command not in COMMANDS:
            raise ConfigError(f"unknown command '{command}'; valid commands: {', '.join(COMMANDS)}")
        status: int = load(command).main(rest)
        return status
    except UserError as exc:
        print(f"kfac-bench: error: {visible(str(exc))}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops a run cleanly: train.signals)
        print("kfac-bench: interrupted", file=sys.stderr, flush=True)
        return 128 + 2


if __name__ == "__main__":
    sys.exit(main())
