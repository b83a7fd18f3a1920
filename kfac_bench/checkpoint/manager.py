"""One checkpoint manager for every part of a run that carries state, saved and restored as a set.

Modelled on torchtitan's ``components/checkpoint.py`` ``CheckpointManager``: the run hands the manager a dict
of *stateful parts* (anything with ``state_dict()`` / ``load_state_dict(state)``: the model, optimizer, LR
scheduler, AMP scaler, preconditioner, train state, target tracker, stage times, random generators) and never
packs a checkpoint by hand. A checkpoint file is ``{part name: part.state_dict(), ...}`` plus the step it was
taken at; the model's weights are under ``"model"`` (BERT phase 2 reads them from the phase-1 file).

Storage is private to the manager (:meth:`CheckpointManager._write` / :meth:`CheckpointManager._read`, on
top of :mod:`kfac_bench.checkpoint.files`): the newest ``keep`` checkpoints as ``step-<N>.pt`` files,
each with a size/SHA-256 manifest written after it, and ``last.pt`` naming the newest. A load verifies the
newest against its manifest and falls back to the newest good one with a one-line warning (the bad ones are
renamed ``*.corrupt``); with none good it stops with one line naming the files. A failed write (disk full,
read-only folder) is one line and leaves every earlier checkpoint intact. Rank 0 writes and chooses which
file to load; every rank reads it.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from kfac_bench import safe_files
from kfac_bench.checkpoint import files, torchfile
from kfac_bench.errors import ConfigError, UserError
from kfac_bench.rank_zero import from_main

__all__ = [
    "CHECKPOINT_DIR",
    "FINITE_PARTS",
    "CheckpointManager",
    "NonFiniteState",
    "PreconditionerState",
    "RNGState",
    "Stateful",
    "nonfinite",
    "save_atomic",
]

CHECKPOINT_DIR = "checkpoints"
LAST = files.LAST
#: Parts whose floating-point tensors must all be finite for a checkpoint to be written or resumed: the
#: weights, the optimizer's moments and K-FAC's factors and decompositions.
FINITE_PARTS = ("model", "optimizer", "precond")


class NonFiniteState(Exception):
    """A checkpoint would hold non-finite values (the run diverged): it is not written.

    Attributes:
        step: the optimizer step of the checkpoint.
        what: which values, in words (e.g. ``model: 5122/5122 values non-finite (first: fc.weight)``).
    """

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"non-finite state at step {step}: {what}")
        self.step, self.what = step, what


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) of every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}.{i}" if prefix else str(i))


def nonfinite(payload: Mapping[str, Any], parts: tuple[str, ...] = FINITE_PARTS) -> str | None:
    """None if every floating-point tensor of ``parts`` of ``payload`` is finite, else what is not, in
    words (per part: how many values of how many, and the first tensor holding one)."""
    found = []
    for part in parts:
        bad = total = 0
        first = None
        for key, t in _tensors(payload.get(part)):
            if not (t.is_floating_point() or t.is_complex()):
                continue
            n = int(t.numel() - torch.isfinite(t).sum())
            bad, total = bad + n, total + t.numel()
            if n and first is None:
                first = key
        if bad:
            found.append(f"{part}: {bad}/{total} values non-finite (first: {first})")
    return "; ".join(found) or None


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
        keep: how many checkpoints to keep (the newest); older ones are deleted after a save succeeds.

    Note:
        :meth:`save` and :meth:`load` are collective under torch.distributed (the preconditioner gathers its
        factors, the generators gather every rank's state, rank 0 shares the outcome of its file work):
        every rank calls them at the same point.
    """

    def __init__(
        self,
        folder: Path,
        parts: Mapping[str, Stateful | None],
        *,
        is_main: bool = True,
        keep: int = 2,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.parts: dict[str, Stateful] = {k: v for k, v in parts.items() if v is not None}
        self.is_main = is_main
        self.keep = keep
        #: The file the last :meth:`load` or :meth:`read` restored from (None: none yet).
        self.loaded_path: Path | None = None

    @property
    def last_path(self) -> Path:
        """The file the newest checkpoint is in."""
        return self.folder / LAST

    def newest(self) -> Path | None:
        """The newest checkpoint file (in save order, unverified), or None if there is none."""
        found, _ = files.candidates(self.folder) if self.folder.is_dir() else ([], [])
        return found[0].path if found else None

    def save(self, step: int) -> None:
        """Checkpoint every part as of optimizer step ``step``.

        Raises:
            NonFiniteState: a part of :data:`FINITE_PARTS` holds a NaN or infinity: nothing is written (the
                newest checkpoint stays the last finite one, and keep-K rotation deletes nothing).
            UserError: the file cannot be written (one line; the earlier checkpoints are intact).
        """
        payload: dict[str, Any] = {name: part.state_dict() for name, part in self.parts.items()}
        payload["step"] = step
        error: tuple[str, str] | None = None  # (kind, message)
        if self.is_main:
            what = nonfinite(payload)
            if what is not None:
                error = ("nonfinite", what)
            else:
                try:
                    self._write(payload)
                except UserError as exc:
                    error = ("write", str(exc))
        # Every rank learns whether the file made it (this is also the barrier after the write).
        error = from_main(error)
        if error is not None:
            kind, message = error
            if kind == "nonfinite":
                raise NonFiniteState(step, message)
            raise UserError(message)

    def load(self) -> bool:
        """Restore every part from the newest good checkpoint; False (nothing changed) if there is none.

        Rank 0 verifies the files (removing temporary files a killed writer left, setting bad checkpoints
        aside as ``*.corrupt`` with a one-line warning) and tells the other ranks which file to read.

        Raises:
            UserError: checkpoints exist but none is good (one line naming them).
            ConfigError: the checkpoint lacks a part this run has (it was written with other settings).
            UserError: the checkpoint holds non-finite weights, optimizer or K-FAC state (one line).
        """
        choice: tuple[str | None, str | None] = (None, None)  # (file to read, error)
        saved = None
        if self.is_main:
            try:
                saved = self._read(owner=True)
                choice = (str(self.loaded_path) if saved is not None else None, None)
            except UserError as exc:
                choice = (None, str(exc))
        path, error = from_main(choice)
        if error is not None:
            raise UserError(error)
        if path is None:
            return False
        if saved is None:
            saved = torchfile.load(path)  # rank 0 read it already: any error here is one line too
            self.loaded_path = Path(path)
        what = nonfinite(saved)
        if what is not None:  # written before checkpoints were checked: never continue from NaN
            raise UserError(
                f"checkpoint {path} (step {saved.get('step')}) holds non-finite state ({what}): the run "
                "diverged before it was saved; start a new run directory (lower optimizer.lr)"
            )
        missing = [name for name in self.parts if name not in saved]
        if missing:
            raise ConfigError(
                f"checkpoint {path} holds no {', '.join(missing)} state: it was written by a run "
                "with other settings (e.g. kfac=none); resume with those settings or use a new run directory"
            )
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])
        return True

    def read(self) -> dict[str, Any] | None:
        """The newest good checkpoint as saved (tensors on the CPU), or None if there is none: for tools
        and tests (reads only; safe on the folder of a run that is still going).

        Raises:
            UserError: checkpoints exist but none is good (one line naming them).
        """
        return self._read()

    def _write(self, payload: dict[str, Any]) -> None:
        files.write_checkpoint(self.folder, payload, int(payload["step"]), self.keep)

    def _read(self, owner: bool = False) -> dict[str, Any] | None:
        """The newest good checkpoint; ``owner`` (the run that writes this folder, rank 0) also removes
        orphaned temporary files and sets rejected checkpoints aside, with a one-line warning."""
        if owner:
            files.check_folder(
                self.folder
            )  # a link, or a checkpoint the run did not write: one line
        if owner and self.folder.is_dir():
            files.remove_orphans(self.folder)
        found = files.load_newest_good(self.folder)
        if found is None:
            return None
        payload, chosen, rejected = found
        self.loaded_path = chosen.path
        if rejected:
            moved = files.quarantine(rejected) if owner else []
            bad = "; ".join(f"{c.path.name} ({why})" for c, why in rejected)
            print(
                f"kfac-bench: warning: skipped bad checkpoint(s) {bad}"
                + (" (kept as *.corrupt)" if moved else "")
                + f"; using {chosen.path} (step {payload.get('step')})",
                file=sys.stderr,
                flush=True,
            )
        return payload


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    """``torch.save(obj)`` to ``path`` so that readers see either the old or the new file, never a partial
    one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    safe_files.replace_file(path, lambda f: torch.save(obj, f), fsync=True)


class RNGState:
    """Python, NumPy, torch CPU and (if present) CUDA generators of every rank.

    ``state_dict`` gathers all ranks' states (collective); ``load_state_dict`` restores this rank's, or rank
    0's when the checkpoint came from another number of ranks.
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    @staticmethod
    def local() -> dict[str, Any]:
        """This process's generator states, as tensors and plain values (a checkpoint is data only: see
        :mod:`kfac_bench.checkpoint.torchfile`)."""
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": random.getstate(),  # (version, tuple of ints, None)
            "numpy": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def set_local(state: dict[str, Any]) -> None:
        """Set this process's generators to ``state`` (from :meth:`local`)."""
        random.setstate(state["python"])
        n = state["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
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
        return self.precond.state_dict(include_decompositions=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.precond.load_state_dict(state_dict)
