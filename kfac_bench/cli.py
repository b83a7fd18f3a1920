"""``kfac-bench``: the command-line entry point (subcommands ``train``, ``compare`` and ``prepare-bert``) and
nothing else.

User mistakes (:class:`kfac_bench.errors.UserError`) print one line and exit with status 2.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Sequence

from kfac_bench.errors import ConfigError, UserError

__all__ = ["COMMANDS", "main"]

USAGE = """usage: kfac-bench <command> [args]

commands:
  train     train a model: kfac-bench train [+recipe=NAME] [group=option] [key=value ...]
            (kfac-bench train --help lists the config groups, options and recipes)
  compare   compare runs: kfac-bench compare BASELINE_RUN_DIR RUN_DIR ... [--out DIR]
  prepare-bert
            BERT pretraining shards (NVIDIA HDF5) from plain text:
            kfac-bench prepare-bert --input FILE ... --output-dir DIR [options] (--help lists them)
"""


def _train(args: Sequence[str]) -> int:
    from kfac_bench.train.app import train_main

    return train_main(args)


def _compare(args: Sequence[str]) -> int:
    from kfac_bench.metrics.compare import compare_main

    return compare_main(args)


def _prepare_bert(args: Sequence[str]) -> int:
    from kfac_bench.data.bert_prepare import main as prepare_main

    # argparse reports a bad argument as usage + error on stderr and exits 2; keep only its error line.
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return prepare_main(list(args))
    except SystemExit as exc:
        if exc.code in (0, None):
            return 0
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        message = lines[-1].split(": error: ", 1)[-1] if lines else f"exit status {exc.code}"
        raise ConfigError(f"prepare-bert: {message} (see kfac-bench prepare-bert --help)") from None


#: Subcommand name -> handler(args) -> exit status. New subcommands add an entry.
COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "train": _train,
    "compare": _compare,
    "prepare-bert": _prepare_bert,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    try:
        if command not in COMMANDS:
            raise ConfigError(f"unknown command '{command}'; valid commands: {', '.join(COMMANDS)}")
        return COMMANDS[command](rest)
    except UserError as exc:
        print(f"kfac-bench: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
