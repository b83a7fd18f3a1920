"""Running the ``mlperf-logging`` package's own compliance checker on a run's ``mlperf.log``, as a user would:
``python -m mlperf_logging.compliance_checker --usage training --ruleset 3.1.0 mlperf.log``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kfac_bench.metrics.mlperf import RULESET
from tests.limits import hang_limit

__all__ = ["check", "events", "missing_or_failed_keys"]


def check(log: Path, division: str | None = None) -> tuple[bool, str]:
    """(passed, the checker's report) for ``log``; ``division`` rewrites ``submission_division`` first (on a
    copy) to apply the other division's rules."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(log)
        if division is not None:
            target = Path(tmp) / "mlperf.log"
            text = Path(log).read_text()
            target.write_text(
                re.sub(
                    r'("key": "submission_division", "value": )"[a-z]+"', rf'\1"{division}"', text
                )
            )
        done = subprocess.run(
            [
                sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                "--ruleset", RULESET, "--log_output", str(Path(tmp) / "checker.log"), str(target),
            ],
            capture_output=True, text=True, timeout=hang_limit(120), cwd=tmp,
        )  # fmt: skip
    return done.returncode == 0, done.stdout + done.stderr


def missing_or_failed_keys(report: str) -> set[str]:
    """The keys the checker's report names as missing or failing a check."""
    keys = set(re.findall(r"occurrence of '([a-z_0-9]+)'", report))
    keys |= set(re.findall(r"CHECK for '([a-z_0-9]+)' failed", report))
    keys |= {f"ATLEAST_ONE:{k}" for k in re.findall(r"Failed checks for ([a-z_0-9]+) :", report)}
    return keys


def events(log: Path) -> list[dict[str, Any]]:
    """The ``:::MLLOG`` events of ``log``, in order."""
    return [
        json.loads(line.split(":::MLLOG ", 1)[1])
        for line in Path(log).read_text().splitlines()
        if ":::MLLOG " in line
    ]
