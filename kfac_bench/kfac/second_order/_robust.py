"""Run a per-factor linear-algebra routine over many factors: batched where it pays, retried in float64."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: One decomposition of one factor: named tensors (``{"q", "eigenvalues"}``, ``{"inverse"}``, ...).
Result = dict[str, torch.Tensor]
#: A layer's second-order parts by name: ``"a"``, ``"g"`` and the method's derived parts.
Parts = dict[str, Result]


def _as_result(out: Result) -> Result:
    return out


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype linear algebra runs in for results stored in ``dtype``: at least float32 (16-bit types
    have no eigensolvers and overflow easily)."""
    return torch.promote_types(dtype, torch.float32)


def run_all(
    fn: Callable[[torch.Tensor], Any],
    factors: Sequence[torch.Tensor],
    dtype: torch.dtype,
    batch_equal_sizes: bool,
    named: Callable[[Any], Result] = _as_result,
) -> list[Result | None]:
    """``named(fn(factor))`` for every factor, computed in :func:`compute_dtype` of ``dtype`` and returned
    in ``dtype``; None where even a float64 retry fails. ``named`` turns ``fn``'s output into a
    :data:`Result` (default: ``fn`` returns one), so that ``fn`` can be the torch routine itself.

    Equal-sized factors are stacked into one call when ``batch_equal_sizes`` (worth it on CUDA, where
    batched small eigensolvers exist; on CPU the batch is a loop plus a copy). Non-finite results are
    detected with a single host synchronisation for all factors, then retried one by one in float64.
    """
    store, dtype = dtype, compute_dtype(dtype)
    results: list[Result | None] = [None] * len(factors)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, f in enumerate(factors):
        key = tuple(f.shape) if batch_equal_sizes else (i,)
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
        try:
            if len(idx) == 1:
                results[idx[0]] = named(fn(factors[idx[0]].to(dtype)))
            else:
                stacked = named(fn(torch.stack([factors[i].to(dtype) for i in idx])))
                for j, i in enumerate(idx):
                    results[i] = {k: v[j] for k, v in stacked.items()}
        except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
            pass
    flags = [
        torch.stack([torch.isfinite(v).all() for v in r.values()]).all()
        for r in results
        if r is not None
    ]
    ok_iter = iter(torch.stack(flags).tolist() if flags else [])  # the one host synchronisation
    finite = [r is not None and next(ok_iter) for r in results]
    for i, ok in enumerate(finite):
        if ok:
            continue
        results[i] = None
        try:
            retry = named(fn(factors[i].to(torch.float64)))
        except RuntimeError:
            continue
        if all(torch.isfinite(v).all() for v in retry.values()):
            results[i] = {k: v.to(dtype) for k, v in retry.items()}
    if store != dtype:
        return [None if r is None else {k: v.to(store) for k, v in r.items()} for r in results]
    return results
