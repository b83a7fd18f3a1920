"""What a run ran on, for ``summary.json``'s ``environment`` and the trackers' tags: enough to reproduce it
or to explain why a rerun differs.

Every value is a string, a bool or None; None means "not present here" (no GPU, a CPU build of torch, a
package not installed, not a git checkout), never a guess.

- ``git_dirty``: whether the kfac-bench source tree had changes against its commit (``summary.json``'s
  ``git_commit``): modified or staged tracked files, or untracked files git does not ignore.
- ``host``: the machine's host name.
- ``gpu``, ``gpu_driver``: the model of the run's CUDA device and the NVIDIA driver version (runs on CUDA).
- ``cuda``, ``nccl``: the CUDA and NCCL versions torch was built with (CUDA builds of torch).
- ``python``, ``torch``, ``torchvision``, ``transformers``: installed versions (read from the package
  metadata, so recording them imports nothing).
"""

from __future__ import annotations

import platform
import re
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["git_commit", "git_dirty", "git_output", "run_environment"]

#: Installed packages whose versions a run records.
PACKAGES = ("torch", "torchvision", "transformers")
_DRIVER_FILE = Path("/proc/driver/nvidia/version")


def git_output(args: list[str], start: Path | None = None, timeout: float = 10) -> str | None:
    """``git ARGS``' output in the work tree holding ``start`` (default: the kfac-bench sources); None
    outside a git checkout, without git, or when it fails."""
    where = start or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", *args], cwd=where, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit(start: Path | None = None) -> str | None:
    """The commit of the work tree holding ``start`` (default: the kfac-bench sources), or None outside
    a git checkout."""
    out = git_output(["rev-parse", "HEAD"], start, timeout=5)
    return out.strip() or None if out is not None else None


def git_dirty(start: Path | None = None) -> bool | None:
    """Whether the git work tree holding ``start`` (default: the kfac-bench sources) differs from its
    commit; None outside a git checkout or without git."""
    out = git_output(["status", "--porcelain"], start)
    return bool(out.strip()) if out is not None else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version (``/proc/driver/nvidia/version``, else ``nvidia-smi``)."""
    try:
        match = re.search(
            r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", _DRIVER_FILE.read_text()
        )
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _nccl_version() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version) if version else None


def run_environment(device: torch.device) -> dict[str, str | bool | None]:
    """The record described in the module docstring, for a run on ``device``."""
    import torch

    on_cuda = device.type == "cuda"
    cuda_build = torch.version.cuda is not None
    return {
        "git_dirty": git_dirty(),
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(device) if on_cuda else None,
        "gpu_driver": _driver_version() if on_cuda else None,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version() if cuda_build else None,
        "python": platform.python_version(),
        **{package: _version(package) for package in PACKAGES},
    }
