"""Same-shaped layers computed together: the stacked running factors, and stacking without copies.

A ResNet's convolutions of one stage, or every block of a transformer, have factors of one shape. Each of
the step's stages runs on them as one batch: the running averages are one ``(B, n, n)`` tensor per shape
and factor (each layer's ``a_factor``/``g_factor`` a view of it), so the fold-in is a handful of ops per
group; the decompositions of a group are one batched ``eigh`` whose results the layers' parts view; and
preconditioning reads those stacks directly. :func:`stack` returns the stack a list of views came from,
and stacks (one copy) only when they did not come from one, so whatever replaced a layer's tensor
(a checkpoint restored, a broadcast received, a decomposition retried alone) costs one copy, never a wrong
result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["fold_running", "stack"]


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``; without a copy when they are consecutive views of one tensor's leading
    dimension (``base[i]``, ``base[i + 1]``, …: a slice of it is returned), or just one tensor; column-major
    matrices are stacked column-major."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0)
    base = first._base
    if (
        base is not None
        and base.dim() == first.dim() + 1
        and base.shape[1:] == first.shape
        and base.stride()[1:] == first.stride()
        and base.stride(0) > 0
    ):
        step = base.stride(0)
        start, rem = divmod(int(first.storage_offset() - base.storage_offset()), int(step))
        if (
            rem == 0
            and start >= 0
            and start + len(tensors) <= base.shape[0]
            and all(
                t._base is base
                and t.storage_offset() == first.storage_offset() + i * step
                and t.shape == first.shape
                and t.stride() == first.stride()
                for i, t in enumerate(tensors)
            )
        ):
            return base.narrow(0, start, len(tensors))
    if first.dim() == 2 and not first.is_contiguous() and first.mT.is_contiguous():
        # Column-major matrices (eigh's eigenvectors) stay column-major, as a batched decomposition's
        # own output is: the batched GEMMs then take the same kernels, bit for bit (e.g. after a resume).
        return torch.stack([t.mT for t in tensors]).mT
    return torch.stack(list(tensors))


def fold_running(
    members: Sequence[tuple[Any, str, torch.Tensor, float]],
    decay: float,
    flags: dict[tuple[str, ...], torch.Tensor],
) -> None:
    """``decay·running + (1-decay)·scale·batch`` for each ``(layer, attribute, batch, scale)`` of one
    shape, in place in one stacked running tensor (the layers' attributes become its views); the first
    update starts from the identity. A non-finite batch leaves its running factor unchanged (decided on the
    device: no host synchronisation) and is recorded in ``flags`` under the members' ``"<layer>/<attr>"``.

    This is the reference code's convention (keep ``decay`` of the old average), not the paper's
    equation, which is written the other way round (TPDS eq. 14-15). The batches are consumed.
    """
    layers = [m[0] for m in members]
    attr = [m[1] for m in members]
    batches = [m[2] for m in members]
    scales = [m[3] for m in members]
    current = [getattr(layer, a) for layer, a in zip(layers, attr)]
    if any(c is None for c in current):
        n, like = batches[0].shape[0], batches[0]
        current = [
            torch.eye(n, dtype=like.dtype, device=like.device) if c is None else c for c in current
        ]
    running = stack(current)
    for layer, a, view in zip(layers, attr, running.unbind(0)):
        setattr(layer, a, view)
    if any(s != 1.0 for s in scales):
        torch._foreach_mul_(batches, scales)
    batch = stack(batches)
    total = batch.sum(dim=(1, 2))
    bad = (total - total).ne(0)  # inf - inf and NaN are NaN; a finite sum gives 0
    # A skipped batch folds in its own running factor: lerp towards itself leaves it as it is.
    batch = torch.where(bad.view(-1, 1, 1), running, batch)
    running.lerp_(batch, 1.0 - decay)
    key = tuple(f"{layer.name}/{a}" for layer, a in zip(layers, attr))
    seen = flags.get(key)
    flags[key] = bad if seen is None else seen.logical_or_(bad)
