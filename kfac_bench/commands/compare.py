"""``kfac-bench compare``: time-to-target of several runs against the first (the baseline); the table and
plot are :mod:`kfac_bench.metrics.compare`'s."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SUMMARY", "main"]

SUMMARY = """\
  compare   compare runs: kfac-bench compare BASELINE_RUN_DIR RUN_DIR ... [--out DIR]"""


def main(args: Sequence[str]) -> int:
    """``kfac-bench compare ARGS``: writes ``compare.md``, ``compare.csv`` and ``compare.png`` to ``--out``
    and prints the table."""
    from kfac_bench.metrics.compare import find_runs, plot, render

    parser = argparse.ArgumentParser(
        prog="kfac-bench compare",
        description="Compare runs against the first (the baseline). A multirun folder adds all its runs.",
    )
    parser.add_argument("runs", nargs="+", help="run directories (or folders holding runs)")
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
    runs = find_runs(ns.runs)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(render(runs, "markdown"))
    (out / "compare.csv").write_text(render(runs, "csv"))
    plot(runs, out / "compare.png")
    print(render(runs, ns.format), end="")
    print(f"wrote {out / 'compare.md'}, {out / 'compare.csv'}, {out / 'compare.png'}")
    return 0
