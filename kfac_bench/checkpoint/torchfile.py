"""Reading ``torch.save`` files as data only: the one ``torch.load`` of every checkpoint kfac-bench reads.

A ``torch.save`` file is a pickle, and unpickling an arbitrary pickle runs whatever functions it names
(``os.system`` included): a planted ``step-N.pt`` (a SHA-256 manifest is a checksum, not a signature), a
``last.pt`` or a ``train.init_from`` / ``model.init_checkpoint`` file would run code before anything could
look at it. :func:`load` therefore reads with ``torch.load(weights_only=True)``: tensors, numbers, strings,
``None`` and lists / tuples / dicts of them. Everything kfac-bench writes into a checkpoint is of those
types (random-generator states included, see :mod:`kfac_bench.checkpoint.manager`).

Two ways a file fails, told apart by what torch raises:

* :class:`RefusedFile`: the pickle names a function or class outside the allowlist (the weights-only
  unpickler's "Unsupported global"): a file made to run code, or another program's pickle. Never loaded,
  never retried unsafely. A checkpoint of kfac-bench before this module (it pickled NumPy's RNG state as an
  ``ndarray``) is refused the same way, with a message of its own (:data:`OLD_FORMAT`).
* :class:`UnreadableFile`: not a torch file, truncated or otherwise corrupt.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from kfac_bench.errors import UserError

__all__ = ["OLD_FORMAT", "RefusedFile", "UnreadableFile", "load"]

#: What the message of a refused file that holds NumPy arrays says: checkpoints of kfac-bench before
#: checkpoints were data-only pickled NumPy's random state that way.
OLD_FORMAT = "written by an older kfac-bench (it pickles NumPy's random state)"

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_OPERAND = re.compile(r"Unsupported operand (\d+)")
_WEIGHTS_ONLY = "Weights only load failed"
#: Pickle opcodes that import or build objects and that the weights-only unpickler does not know
#: (INST, OBJ, EXT1/2/4, STACK_GLOBAL, NEWOBJ_EX): a pickle that uses them wants code, it is not garbage.
_CODE_OPCODES = {ord("i"), ord("o"), 0x82, 0x83, 0x84, 0x92, 0x93}
#: The weights-only unpickler's words for a call or an object it will not make.
_CODE_WORDS = ("reduce for unrecognized function", "Can only create new object", "Can only build")


class RefusedFile(UserError):
    """A torch file whose pickle names code (a global outside the weights-only allowlist): refused unread."""

    def __init__(self, path: Path, what: str, detail: str) -> None:
        self.path, self.detail = path, detail
        self.old_format = detail.startswith("numpy")
        if self.old_format:
            msg = (
                f"{what} {path} is {OLD_FORMAT}: checkpoints are loaded as data only and this one holds "
                f"pickled objects ({detail}); resume it with the kfac-bench version that wrote it, or start "
                "a new run directory"
            )
        else:
            msg = (
                f"{what} {path} refused: its pickle calls {detail}, which no checkpoint holds (checkpoints "
                "are loaded as data only, so it was not run); remove the file, it may be hostile"
            )
        super().__init__(msg)


class UnreadableFile(UserError):
    """Not a torch file, or a truncated / corrupt one."""

    def __init__(self, path: Path, what: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{what} {path} is unreadable (corrupt or not a torch file: {reason})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def _detail(text: str) -> str:
    """The weights-only unpickler's own line inside torch's long message (its wording varies by version)."""
    for line in text.splitlines():
        line = line.strip().removeprefix("WeightsUnpickler error:").strip()
        if _GLOBAL.search(line) or _OPERAND.search(line) or any(w in line for w in _CODE_WORDS):
            return line
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-2] if len(lines) > 1 else (lines[0] if lines else "")


def load(path: str | os.PathLike[str], what: str = "checkpoint") -> Any:
    """``torch.load(path)`` of tensors and plain containers only, onto the CPU.

    Args:
        what: how messages name the file (``"checkpoint"``, ``"model.init_checkpoint"``).

    Raises:
        RefusedFile: the pickle names a function or class (it would run code): never loaded.
        UnreadableFile: the file is not a torch file, or it is truncated or corrupt.
        OSError: the file cannot be opened.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if _WEIGHTS_ONLY not in text:
            raise UnreadableFile(path, what, _first_line(exc)) from None
        detail = _detail(text)
        found, operand = _GLOBAL.search(detail), _OPERAND.search(detail)
        if found:
            raise RefusedFile(path, what, found.group(1)) from None
        if (operand and int(operand.group(1)) in _CODE_OPCODES) or any(
            w in detail for w in _CODE_WORDS
        ):
            raise RefusedFile(
                path, what, f"code the loader does not allow ({detail[:120]})"
            ) from None
        raise UnreadableFile(path, what, f"not a pickle torch reads: {detail[:120]}") from None
    except OSError:
        raise
    except Exception as exc:  # torch raises many unrelated types for a file it cannot read
        raise UnreadableFile(path, what, _first_line(exc)) from None
