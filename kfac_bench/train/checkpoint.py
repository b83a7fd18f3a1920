"""Atomic checkpoints with everything a bit-identical resume needs.

One file, ``<run dir>/checkpoints/last.pt``, replaced atomically (write a temporary file in the same
directory, fsync, ``os.replace``), so a crash while saving leaves the previous checkpoint intact. Rank 0
writes; every rank reads.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["checkpoint_path", "load", "rng_state", "save_atomic", "set_rng_state"]

FILE = "last.pt"


def checkpoint_path(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints" / FILE


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    """``torch.save(obj)`` to ``path`` so that readers see either the old or the new file, never a partial
    one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (tensors on the CPU), or None if there is none."""
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (if present) CUDA generator states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
