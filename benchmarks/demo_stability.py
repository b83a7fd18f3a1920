"""Does ``make train`` give the same verdict every time? Runs ``kfac-bench demo`` N times in a row.

Run ``python -m benchmarks.demo_stability`` (10 demos; ``--runs N``, and any ``kfac-bench demo`` option
after ``--``, e.g. ``-- --seeds 0 1 2 3 4``). Each demo is a fresh ``kfac-bench demo`` process with its own
folder under ``--out`` (default: a temporary folder, removed at the end unless ``--keep``). It prints each
demo's verdict line and its wall time, then how many demos made the most common claim about the clock: the
claim is the ``claim`` column of the demo's ``compare.csv`` (``faster``, ``slower`` or ``none``: what the
time-to-target interval supports), read as data, never parsed out of the verdict's words. Also printed:
the machine's load average before and after, since a loaded machine widens every interval.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def claim_of(compare_csv: Path) -> str:
    """The clock claim of a two-arm comparison: the ``claim`` column of the arm's row (the row after the
    baseline's) in ``compare_csv``; "?" when the file or the row is missing."""
    try:
        with compare_csv.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return "?"
    return rows[1].get("claim") or "?" if len(rows) > 1 else "?"


def verdict_of(stdout: str) -> str:
    """The demo's verdict line (the last line starting with "verdict:"), or "" if it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith("verdict:")]
    return lines[-1] if lines else ""


def _demo(out: Path, extra: Sequence[str]) -> tuple[str, float, int]:
    exe = Path(sys.executable).with_name("kfac-bench")
    command = [str(exe) if exe.exists() else "kfac-bench", "demo", "--out", str(out), *extra]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-2000:])
    return verdict_of(done.stdout), seconds, done.returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.demo_stability", description=__doc__
    )
    parser.add_argument("--runs", type=int, default=10, help="demos in a row (default 10)")
    parser.add_argument("--out", help="folder for the demos' folders (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the demos' folders")
    ns = parser.parse_args(own)
    root = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="demo_stability_"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    claims: list[str] = []
    try:
        for i in range(ns.runs):
            verdict, seconds, code = _demo(root / f"demo{i}", extra)
            claim = claim_of(root / f"demo{i}" / "compare.csv") if code == 0 else f"failed ({code})"
            claims.append(claim)
            print(f"demo {i + 1}/{ns.runs} ({seconds:.0f} s): [{claim}] {verdict}", flush=True)
    finally:
        if not ns.out and not ns.keep:
            shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    (top, count), *_ = collections.Counter(claims).most_common()
    print(
        f"same clock claim in {count}/{len(claims)} demos: '{top}' "
        f"({dict(collections.Counter(claims))}); load average before {load_before[0]:.1f}, "
        f"after {load_after[0]:.1f} (1 min), {os.cpu_count()} cores"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
