"""``kfac-bench compare``: time-to-target of arms (runs grouped by optimizer and K-FAC strategy, several
seeds into median and spread) against a baseline (the first first-order arm unless ``--baseline`` names
one), with 95 % confidence intervals and a one-line verdict per arm; the table and plot are
:mod:`kfac_bench.compare.report`'s. One campaign at a time (``--by-campaign``: each campaign its own
arms); the files go to a new folder inside the compared folder unless ``--out`` names one."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SUMMARY", "main"]

SUMMARY = """\
  compare   compare runs by arm: kfac-bench compare RUN_DIR ... [--baseline ARM|DIR] [--out DIR]
            [--by-campaign]
            BERT chains: kfac-bench compare --chain lamb=P1,P2,SQUAD --chain kfac=P1,P2,SQUAD"""


def main(args: Sequence[str]) -> int:
    """``kfac-bench compare ARGS``: writes ``compare.md``, ``compare.csv`` and ``compare.png`` to ``--out``
    (default: a new ``compare_<time>_<uid>`` folder inside the compared folder) and prints the table."""
    from kfac_bench.compare.report import default_out, find_runs, output_dir, write_outputs

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
        "--out",
        help="folder for compare.md/.csv/.png (default: a new compare_<time>_<uid> folder inside the "
        "compared folder, so a comparison never overwrites another; runs/ when that is the current "
        "directory)",
    )
    parser.add_argument(
        "--by-campaign",
        action="store_true",
        help="runs of several campaigns (sweep folders, train.campaign): compare each campaign's runs "
        "as separate arms (default: refuse to pool them)",
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
    if ns.out is not None:
        output_dir(ns.out).close()  # a bad --out (a file, not empty) stops before the runs are read
    runs = find_runs(ns.runs, by_campaign=ns.by_campaign)
    out = Path(ns.out) if ns.out is not None else default_out(ns.runs)
    print(write_outputs(runs, out, ns.format, ns.baseline), end="")
    return 0


def _compare_chains(ns: argparse.Namespace) -> int:
    """Final SQuAD F1 and time to solution per chain (:mod:`kfac_bench.compare.chain`)."""
    from kfac_bench.compare.chain import compare_chains, parse_chain, render_chains
    from kfac_bench.compare.report import default_out, output_dir
    from kfac_bench.errors import UserError

    if not ns.chain or ns.runs:
        given = "both" if ns.runs else "neither"
        raise UserError(
            f"compare: give run directories or BERT chains (--chain NAME=P1,P2,SQUAD), not {given}"
        )
    if ns.out is None:  # a new folder, made once the chains are read
        out = default_out([p for spec in ns.chain for p in parse_chain(spec)[1]], "chains")
    else:
        out = Path(ns.out)
        output_dir(out).close()  # a bad --out stops before the chains are read
    chains = compare_chains(ns.chain, out)
    print(render_chains(chains, ns.format), end="")
    print(f"wrote {out / 'chains.md'}, {out / 'chains.csv'}")
    return 0
