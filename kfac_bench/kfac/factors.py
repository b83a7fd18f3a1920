"""Kronecker factors from their unnormalised sums: the two scaling conventions and the running average.

Notation (per layer): ``N`` examples, ``T`` positions per example, rows ``a`` (input, bias 1 appended) and
``g`` (gradient of the *loss* w.r.t. the layer output, as autograd delivers it). For a loss that is the mean
over the batch (and divided by ``accumulation_steps`` when accumulating), ``g = δ / N_total`` where ``δ`` is
the gradient of the per-example loss.

``'per_example'`` (SC20/TPDS ResNet code; textbook K-FAC and KFC, Grosse & Martens 2016):
    A = (1/N) Σₙ Σₜ a aᵀ                  (KFC's Ω: summed over positions)
    G = (1/N) Σₙ (1/T) Σₜ δ δᵀ = (N/T) Σ g gᵀ   (KFC's Γ: averaged over positions)
    For Linear without extra dimensions (T = 1) these are E[a aᵀ] and E[δ δᵀ] (F̂ᵢ = A ⊗ G of TPDS §2.3).
    The SC20 code splits the same Kronecker product A ⊗ G differently for convolutions (A/T², G·T²); the
    eigen method depends only on the product, so its results are identical.

``'kaisa'`` (KAISA-era code, used for the Mask R-CNN and BERT results; kfac-pytorch ``get_cov``):
    A = (1/(N·T)) Σ a aᵀ · s,   G = (1/(N·T)) Σ g gᵀ · s,   with s = 1/T² for convolutions, 1 for Linear
    (every token a row, no position normalisation). G carries no batch-size rescaling, so it depends on the
    (local) batch size: a damping tuned under one convention does not transfer to the other.

Both are sums over rows divided by counts, so splitting a batch into accumulated micro-batches (with the loss
divided by their number) gives the same factors as one pass over the whole batch.

Several calls of a layer in one backward pass (weight sharing across time, two views of a batch, a module
applied twice) are *position sets of the same examples*: with calls of ``T₁ … T_k`` positions on the same
``N`` examples, ``T = Σ Tᵢ`` above and ``N`` is counted once (the largest batch dimension among the calls).
Under ``'kaisa'`` every row of every call is a row of the mean, as in the reference code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layers import Gram
from .options import FactorScaling


def fold(
    scaling: FactorScaling, spatial: bool, calls: Sequence[tuple[Gram, Gram]]
) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
    """One backward pass's ``(A sum, count), (G sum, count)`` of a layer from its calls' ``(A, G)`` grams.

    The sums are weighted so that :func:`normalise` of the accumulated sums and counts gives the factors of
    the module docstring; for one call this is :func:`contribution_weight` and :func:`contribution_count`.
    """
    if scaling is FactorScaling.PER_EXAMPLE and len(calls) > 1:
        positions = sum(g.positions for _, g in calls)
        examples = max(a.examples for a, _ in calls)
        a_sum = torch.stack([a.sum for a, _ in calls]).sum(0)
        g_sum = torch.stack([g.sum for _, g in calls]).sum(0) / positions
        return (a_sum, examples), (g_sum, examples)
    sums: list[tuple[torch.Tensor, int]] = []
    for i, is_g in ((0, False), (1, True)):
        total: torch.Tensor | None = None
        count = 0
        for pair in calls:
            gram = pair[i]
            w = contribution_weight(scaling, is_g, spatial, gram.positions)
            contrib = gram.sum if w == 1.0 else gram.sum * w
            total = contrib if total is None else total + contrib
            count += contribution_count(scaling, gram.examples, gram.positions)
        assert total is not None
        sums.append((total, count))
    return sums[0], sums[1]


def contribution_weight(scaling: FactorScaling, is_g: bool, spatial: bool, positions: int) -> float:
    """Weight of one micro-batch's Σ r rᵀ in the factor's accumulated sum."""
    if scaling is FactorScaling.PER_EXAMPLE:
        return 1.0 / positions if is_g else 1.0
    return 1.0 / positions**2 if spatial else 1.0


def contribution_count(scaling: FactorScaling, examples: int, positions: int) -> int:
    """What one micro-batch adds to the factor's normalising count (examples, or rows)."""
    return examples if scaling is FactorScaling.PER_EXAMPLE else examples * positions


def normalise(total: torch.Tensor, count: int, scaling: FactorScaling, is_g: bool) -> torch.Tensor:
    """The batch factor from its accumulated weighted sum and count (see the module docstring), computed in
    place in ``total`` (consumed; the same values as out of place): a new factor-sized tensor every factor
    step would cost more than the whole fold-in (fresh pages)."""
    if scaling is FactorScaling.PER_EXAMPLE and is_g:
        return total.mul_(count)
    return total.div_(count)


def running_average(
    running: torch.Tensor | None, batch: torch.Tensor, decay: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decay·running + (1-decay)·batch`` in place in ``running``; the first update starts from eye.

    This is the reference code's convention (keep ``decay`` of the old average), not the paper's
    equation, which is written the other way round (TPDS eq. 14-15). A non-finite ``batch`` leaves the
    running factor unchanged (decided on the device, without a host synchronisation).

    ``batch`` is consumed: it may be overwritten. One pass over it decides finiteness (its sum is finite),
    one in-place ``lerp_`` folds it in: no temporaries (a sum that overflows counts as non-finite).

    Returns:
        ``(running, bad)``: the updated running factor (the same tensor when one was given) and a
        device-side bool scalar, true when ``batch`` was skipped as non-finite.
    """
    if running is None:
        running = torch.eye(batch.shape[0], dtype=batch.dtype, device=batch.device)
    bad = ~torch.isfinite(batch.sum())
    # A skipped batch must not touch the average: zero it (0·inf would be NaN) and keep the old weight.
    batch.masked_fill_(bad, 0.0)
    weight = torch.where(bad, 0.0, 1.0 - decay).to(running.dtype)
    running.lerp_(batch, weight)
    return running, bad
