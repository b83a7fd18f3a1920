"""``kfac-bench compare``: time-to-target of arms (runs grouped by optimizer and K-FAC strategy, several
seeds into median and spread) against a baseline (the first first-order arm unless ``--baseline`` names
one), with a one-line verdict; the table and plot are :mod:`kfac_bench.compare.report`'s."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SUMMARY", "main"]

SUMMARY = """\
  compare   compare runs by arm: kfac-bench compare RUN_DIR ... [--baseline ARM|DIR] [--out DIR]
            BERT chains: kfac-bench compare --chain lamb=P1,P2,SQUAD --chain kfac=P1,P2,SQUAD"""


def main(args: Sequence[str]) -> int:
    """``kfac-bench compare ARGS``: writes ``compare.md``, ``compare.csv`` and ``compare.png`` to ``--out``
    and prints the table."""
    from kfac_bench.compare.report import find_runs, output_dir, write_outputs

    parser = argparse.ArgumentParser(
        prog="kfac-bench compare",
        description="Compare runs by arm (runs of one arm and setting with different seeds: median and "
        "spread) against a baseline, by default the first first-order arm. A multirun folder adds all "
        "its runs.",
    )
    parser.add_argument("runs", nargs="*", help="run directories (or folders holding runs)")
    parser.add_argument(
        "--chain",
        action="append",
        default=[],
        metavar="NAME=P1,P2,SQUAD",
        help="a BERT chain: its pretraining runs, then its SQuAD run (repeat; the first is the baseline)",
    )
    parser.add_argument(
        "--baseline",
        metavar="ARM|RUN_DIR",
        help="the baseline: an arm's label as printed (e.g. 'SGD') or one of its run directories "
        "(default: the first first-order arm, else the first arm)",
    )
    parser.add_argument(
        "--out", default="compare", help="folder for compare.md/.csv/.png (default: compare)"
    )
    parser.add_argument(
        "--format",
        choices=("terminal", "markdown", "csv"),
        default="terminal",
        help="table printed",
    )
    ns = parser.parse_args(list(args))
    if ns.chain or not ns.runs:
        return _compare_chains(ns)
    output_dir(ns.out)  # a bad --out stops before the runs are read
    runs = find_runs(ns.runs)
    print(write_outputs(runs, Path(ns.out), ns.format, ns.baseline), end="")
    return 0


def _compare_chains(ns: argparse.Namespace) -> int:
    """Final SQuAD F1 and time to solution per chain (:mod:`kfac_bench.compare.chain`)."""
    from kfac_bench.compare.chain import compare_chains, render_chains
    from kfac_bench.compare.report import output_dir
    from kfac_bench.errors import UserError

    if not ns.chain or ns.runs:
        given = "both" if ns.runs else "neither"
        raise UserError(
            f"compare: give run directories or BERT chains (--chain NAME=P1,P2,SQUAD), not {given}"
        )
    out = output_dir(ns.out)
    chains = compare_chains(ns.chain, out)
    print(render_chains(chains, ns.format), end="")
    print(f"wrote {out / 'chains.md'}, {out / 'chains.csv'}")
    return 0
