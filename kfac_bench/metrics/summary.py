"""``summary.json``: what a finished (or stopped) run reports, read by ``kfac-bench compare``."""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "STATUSES",
    "SUMMARY_FILE",
    "git_commit",
    "peak_memory_bytes",
    "read_summary",
    "write_summary",
]

SUMMARY_FILE = "summary.json"
#: success: target met (or none set and the run finished); target_not_reached: finished below target;
#: diverged: a non-finite loss stopped it; preempted: stopped by a signal, resumable.
STATUSES = ("success", "target_not_reached", "diverged", "preempted")


def git_commit(start: Path | None = None) -> str | None:
    """The commit of the kfac-bench source tree, or None outside a git checkout."""
    where = start or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """Peak accelerator memory allocated by tensors (CUDA) and peak resident memory of this process."""
    peak = {"host_max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peak["device_max_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return peak


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` atomically (a temporary file, then rename)."""
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
