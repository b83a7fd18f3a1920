"""Kronecker factors from their unnormalised sums: the three scaling conventions and the running average.

Notation (per layer): ``N`` examples, ``T`` positions per example, rows ``a`` (input, bias 1 appended) and
``g`` (gradient of the *loss* w.r.t. the layer output, as autograd delivers it). For a loss that is the mean
over the batch (and divided by ``accumulation_steps`` when accumulating), ``g = δ / N_total`` where ``δ`` is
the gradient of the per-example loss.

``'expand'`` (the default): K-FAC-expand (Eschenhagen et al., NeurIPS 2023, §3) for layers whose
positions are not spatial (Linear and Linear-like handlers): every row is one term of the loss's mean,
whatever the tensor layout that carried it. With ``R`` the rows the layer processed and ``L`` the number
of terms of the backward pass, taken as the largest number of rows any registered Linear-type layer
processed in it (its calls summed; the layers that see every token)::

    A = (1/R) Σ_rows a aᵀ,   G = L · Σ_rows g gᵀ

Rows, not examples or positions, are counted, so ``(N, T, d)``, ``(N·T, d)`` and ``(T, N, d)`` inputs (and
``k`` calls of ``N`` rows against one of ``k·N``) give the same factors: the engine sees rows only and
guesses no batch dimension. For a loss that is the mean over its ``L`` rows (a token-level loss),
``G = (R/L)·E[δ δᵀ]`` of the per-row loss gradient δ and ``A ⊗ G`` is the layer's K-FAC-expand Fisher
block: ``(R/L)·E[a aᵀ] ⊗ E[δ δᵀ]``. A layer that sees every row (``R = L``) has ``A ⊗ G = Σ a aᵀ ⊗ Σ g gᵀ``;
an MoE expert that received ``n`` of the ``L`` tokens has its Fisher block, linear in its load ``n/L``
(``R`` in place of ``L`` would make it quadratic). A loss that is a mean over ``N`` sequences of ``T``
rows scales every Linear-type layer's product alike, ``T`` times its per-example (KFC-style) value.
Convolutions keep KFC (``'per_example'`` below): their positions are the output pixels of one image, fixed
by the layer, not by a reshape, and KFC's factors are exact for a per-example loss under its assumptions
(Grosse & Martens 2016, §3: independent activations and derivatives, spatial homogeneity, spatially
uncorrelated derivatives); a model whose Linear layers see one row per example (a CNN's classifier) has
``L = N`` and every factor exactly as under ``'per_example'``.

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

All three are sums over rows divided by counts, so splitting a batch into accumulated micro-batches (with the
loss divided by their number) gives the same factors as one pass over the whole batch.

Several calls of a layer in one backward pass (weight sharing across time, two views of a batch, a module
applied twice) are *position sets of the same examples*: with calls of ``T₁ … T_k`` positions on the same
``N`` examples, ``T = Σ Tᵢ`` above and ``N`` is counted once (the largest batch dimension among the calls).
Under ``'kaisa'``, and for Linear-type layers under ``'expand'``, every row of every call is a row of
the mean (so ``k`` calls of ``N`` rows equal one call of ``k·N`` rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layers import Gram
from .options import FactorScaling


def fold(
    scaling: FactorScaling, spatial: bool, calls: Sequence[tuple[Gram, Gram]], terms: int = 0
) -> tuple[tuple[torch.Tensor, int, float], tuple[torch.Tensor, int, float]]:
    """One backward pass's ``(A sum, count, weight), (G sum, count, weight)`` of a layer from its calls'
    ``(A, G)`` grams: the weighted sum is ``weight · sum``.

    The sums are weighted so that :func:`normalise` of the accumulated sums and counts gives the factors of
    the module docstring; for one call this is :func:`contribution_weight` and :func:`contribution_count`,
    returned as the weight rather than applied (the accumulator applies it with its normalisation, in
    the same op). ``terms``: ``L`` of the backward pass under ``'expand'`` (0: the layer's own rows).
    """
    scaling = effective(scaling, spatial)
    if scaling is FactorScaling.PER_EXAMPLE and len(calls) > 1:
        positions = sum(g.positions for _, g in calls)
        examples = max(a.examples for a, _ in calls)
        a_sum = torch.stack([a.sum for a, _ in calls]).sum(0)
        g_sum = torch.stack([g.sum for _, g in calls]).sum(0)
        return (a_sum, examples, 1.0), (g_sum, examples, 1.0 / positions)
    sums: list[tuple[torch.Tensor, int, float]] = []
    for i, is_g in ((0, False), (1, True)):
        total: torch.Tensor | None = None
        weight = 1.0
        count = 0
        for pair in calls:
            gram = pair[i]
            w = contribution_weight(scaling, is_g, spatial, gram.positions)
            if total is None:
                total, weight = gram.sum, w
            else:
                total = total * weight + gram.sum * w if weight != 1.0 else total + gram.sum * w
                weight = 1.0
            count += contribution_count(scaling, gram.examples, gram.positions, spatial)
        assert total is not None
        if is_g and scaling is FactorScaling.EXPAND and terms > 0:
            count = terms
        sums.append((total, count, weight))
    return sums[0], sums[1]


def effective(scaling: FactorScaling, spatial: bool) -> FactorScaling:
    """The convention a layer's factors follow: ``'expand'`` is ``'per_example'`` (KFC) for convolutions."""
    if scaling is FactorScaling.EXPAND and spatial:
        return FactorScaling.PER_EXAMPLE
    return scaling


def contribution_weight(scaling: FactorScaling, is_g: bool, spatial: bool, positions: int) -> float:
    """Weight of one micro-batch's Σ r rᵀ in the factor's accumulated sum."""
    scaling = effective(scaling, spatial)
    if scaling is FactorScaling.EXPAND:
        return 1.0
    if scaling is FactorScaling.PER_EXAMPLE:
        return 1.0 / positions if is_g else 1.0
    return 1.0 / positions**2 if spatial else 1.0


def contribution_count(
    scaling: FactorScaling, examples: int, positions: int, spatial: bool = False
) -> int:
    """What one micro-batch adds to the factor's normalising count (examples, or rows)."""
    if effective(scaling, spatial) is FactorScaling.PER_EXAMPLE:
        return examples
    return examples * positions


def normaliser(count: int, scaling: FactorScaling, is_g: bool) -> float:
    """The factor's accumulated weighted sum times this is the batch factor (module docstring)."""
    if scaling is not FactorScaling.KAISA and is_g:  # 'per_example', 'expand': G = count · Σ g gᵀ
        return float(count)
    return 1.0 / count


def normalise(
    total: torch.Tensor, count: int, scaling: FactorScaling, is_g: bool, weight: float = 1.0
) -> torch.Tensor:
    """The batch factor from its accumulated sum (times ``weight``) and count (see the module docstring),
    computed in place in ``total`` (consumed): a new factor-sized tensor every factor step would cost more
    than the whole fold-in (fresh pages)."""
    return total.mul_(weight * normaliser(count, scaling, is_g))


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
