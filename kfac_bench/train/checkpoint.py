"""One checkpoint manager for every part of a run that carries state, saved and restored as a set.

Modelled on torchtitan's ``components/checkpoint.py`` ``CheckpointManager``: the run hands the manager a dict
of *stateful parts* (anything with ``state_dict()`` / ``load_state_dict(state)``: the model, optimizer, LR
scheduler, AMP scaler, preconditioner, train state, target tracker, stage times, random generators) and never
packs a checkpoint by hand. A checkpoint file is ``{part name: part.state_dict(), ...}`` plus the step it was
taken at; the model's weights are under ``"model"`` (BERT phase 2 reads them from the phase-1 file).

Storage is private to the manager (:meth:`CheckpointManager._write` / :meth:`CheckpointManager._read`): today
one file, ``<run dir>/checkpoints/last.pt``, replaced atomically (write a temporary file in the same folder,
fsync, ``os.replace``), so a crash while saving leaves the previous checkpoint intact. Keeping the last K
checkpoints with a manifest and falling back to the newest good one changes only those two methods.
Rank 0 writes; every rank reads.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from kfac_bench.errors import ConfigError

__all__ = [
    "CHECKPOINT_DIR",
    "CheckpointManager",
    "PreconditionerState",
    "RNGState",
    "Stateful",
    "save_atomic",
]

CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"


@runtime_checkable
class Stateful(Protocol):
    """A part of a run that a checkpoint saves and restores (``torch.distributed.checkpoint``'s protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class CheckpointManager:
    """Saves and restores a run's stateful parts as one checkpoint.

    Args:
        folder: where checkpoints live (``<run dir>/checkpoints``).
        parts: part name -> stateful part; None values (e.g. no preconditioner in a first-order run, no AMP
            scaler on the CPU) are left out. Parts are saved and restored in this order: put the random
            generators last.
        is_main: whether this process writes (rank 0).

    Note:
        :meth:`save` and :meth:`load` are collective under torch.distributed (the preconditioner gathers its
        factors, the generators gather every rank's state): every rank calls them at the same point.
    """

    def __init__(
        self, folder: Path, parts: Mapping[str, Stateful | None], *, is_main: bool = True
    ) -> None:
        self.folder = Path(folder)
        self.parts: dict[str, Stateful] = {k: v for k, v in parts.items() if v is not None}
        self.is_main = is_main

    @property
    def last_path(self) -> Path:
        """The file the newest checkpoint is in."""
        return self.folder / LAST

    def save(self, step: int) -> None:
        """Checkpoint every part as of optimizer step ``step``."""
        payload: dict[str, Any] = {name: part.state_dict() for name, part in self.parts.items()}
        payload["step"] = step
        if self.is_main:
            self._write(payload)
        if _distributed():
            dist.barrier()

    def load(self) -> bool:
        """Restore every part from the newest checkpoint; False (nothing changed) if there is none.

        Raises:
            ConfigError: the checkpoint lacks a part this run has (it was written with other settings).
        """
        saved = self._read()
        if saved is None:
            return False
        missing = [name for name in self.parts if name not in saved]
        if missing:
            raise ConfigError(
                f"checkpoint {self.last_path} holds no {', '.join(missing)} state: it was written by a run "
                "with other settings (e.g. kfac=none); resume with those settings or use a new run directory"
            )
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])
        return True

    def read(self) -> dict[str, Any] | None:
        """The newest checkpoint as saved (tensors on the CPU), or None: for tools and tests."""
        return self._read()

    def _write(self, payload: dict[str, Any]) -> None:
        save_atomic(payload, self.last_path)

    def _read(self) -> dict[str, Any] | None:
        if not self.last_path.is_file():
            return None
        return torch.load(self.last_path, map_location="cpu", weights_only=False)


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


class RNGState:
    """Python, NumPy, torch CPU and (if present) CUDA generators of every rank.

    ``state_dict`` gathers all ranks' states (collective); ``load_state_dict`` restores this rank's, or rank
    0's when the checkpoint came from another number of ranks.
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    @staticmethod
    def local() -> dict[str, Any]:
        """This process's generator states."""
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def set_local(state: dict[str, Any]) -> None:
        """Set this process's generators to ``state`` (from :meth:`local`)."""
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def state_dict(self) -> dict[str, Any]:
        mine = self.local()
        ranks: list[Any] = [mine]
        if _distributed():
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, mine)
        return {"ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict["ranks"]
        self.set_local(ranks[self.rank] if len(ranks) == self.world_size else ranks[0])


class PreconditionerState:
    """The preconditioner as a checkpoint part: its state *with* the current decompositions, so a resumed
    run continues bit-identically even between decomposition steps (collective under torch.distributed)."""

    def __init__(self, precond: Any) -> None:
        self.precond = precond

    def state_dict(self) -> dict[str, Any]:
        return self.precond.state_dict(include_decompositions=True)  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.precond.load_state_dict(state_dict)
