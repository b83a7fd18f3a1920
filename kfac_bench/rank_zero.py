"""What every rank agrees on: a value as rank 0 has it.

Rank 0 alone reads the run dir and chooses (a checkpoint, an error to report, an evaluation's metrics); the
other ranks take its choice, so every rank acts on the same facts."""

from __future__ import annotations

from typing import Any

__all__ = ["from_main"]


def from_main(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank (unchanged outside a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
