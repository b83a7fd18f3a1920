"""Factor statistics from a random part of each batch: ``factor_batch_fraction`` (opt-in, approximate).

Martens & Grosse (2015, §5) estimate K-FAC's curvature statistics on a subset of the mini-batch: the
factors are expectations, a random subset of the examples estimates them without bias, and the running
average over steps (``factor_decay``) absorbs the extra noise. The price is stated, not hidden: the batch
factors are noisier (measured on digits: 2.6 %, 4.4 %, 7.1 % preconditioned-gradient error at 1/2, 1/4,
1/8 of the examples; README "Cheaper factor statistics"), and the factor stage costs about the fraction.

What the hooks do with ``fraction < 1`` (see :mod:`.capture`):

* each micro-batch draws ``k = max(1, round(fraction·N))`` of its ``N`` examples (rows of the leading
  dimension, the handlers' example axis) without replacement; every layer uses the same draw for its input
  and its output gradient, so A and G of a call describe the same examples;
* the draw is a function of the preconditioner's step, the micro-batch index and ``N`` only, so a resumed
  run draws what the uninterrupted run drew, and every rank draws the same positions of its own batch;
* A is the mean over the ``k`` examples (its count is ``k``); under ``'per_example'`` scaling autograd's
  output gradient carries ``1/N`` of the full batch, so the G sum is multiplied by ``(N/k)²`` to be the same
  mean over the ``k`` examples; under ``'kaisa'`` G is a mean over rows and needs no correction.

With ``fraction = 1`` nothing is drawn and the path is the exact one, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .options import FactorScaling

__all__ = ["ExampleSubset", "check_fraction"]


def check_fraction(fraction: float) -> float:
    """``factor_batch_fraction`` as a float in (0, 1]; a ValueError names the valid range."""
    value = float(fraction)
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"factor_batch_fraction={fraction!r} must be in (0, 1] (1 = every example, exact)"
        )
    return value


class ExampleSubset:
    """The examples each micro-batch's factors are computed from (module docstring: the rules).

    Args:
        fraction: share of the examples, in (0, 1).
        scaling: the factor-scaling convention (decides the G correction).
        steps: the preconditioner's current step count (read at each draw).
    """

    def __init__(self, fraction: float, scaling: FactorScaling, steps: Callable[[], int]) -> None:
        self.fraction = check_fraction(fraction)
        self.scaling = scaling
        self.steps = steps
        self._key: tuple[int, int, int, torch.device] | None = None
        self._rows: torch.Tensor | None = None

    def rows(self, x: torch.Tensor, micro_batch: int, spatial: bool) -> torch.Tensor | None:
        """Sorted indices of the examples of ``x`` to use, or None for all of them (too few to thin out,
        or an input without an example axis: 1-D, or an unbatched 3-D image of a spatial layer)."""
        if x.dim() < 2 or (spatial and x.dim() < 4):
            return None
        n = x.shape[0]
        k = max(1, round(self.fraction * n))
        if k >= n:
            return None
        key = (self.steps(), micro_batch, n, x.device)
        if key != self._key:  # one draw per micro-batch, shared by every layer
            g = torch.Generator().manual_seed(
                (key[0] * 1_000_003 + micro_batch * 1_009 + n) % 2**62
            )
            rows = torch.randperm(n, generator=g)[:k].sort().values
            self._key, self._rows = key, rows.to(x.device)
        return self._rows

    def g_weight(self, n: int, k: int) -> float:
        """Factor on the G sum of ``k`` of ``n`` examples (see the module docstring)."""
        if self.scaling is FactorScaling.PER_EXAMPLE:
            return (n / k) ** 2
        return 1.0
