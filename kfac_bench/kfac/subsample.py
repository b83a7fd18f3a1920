"""Factor statistics from a random part of each batch: ``factor_batch_fraction`` and, for convolutions,
``factor_position_fraction`` (both opt-in, approximate).

Martens & Grosse (2015, §5) estimate K-FAC's curvature statistics on a subset of the mini-batch: the
factors are expectations, a random subset of the examples estimates them without bias, and the running
average over steps (``factor_decay``) absorbs the extra noise. The price is stated, not hidden: the batch
factors are noisier (the preconditioned-gradient error grows as the fraction shrinks; ``docs/performance.md``
has the measurements), and the factor stage costs about the fraction.

What the hooks do with ``fraction < 1`` (see :mod:`.capture`):

* each micro-batch draws ``k = max(1, round(fraction·N))`` of its ``N`` examples (rows of the leading
  dimension, the handlers' example axis) without replacement; every layer uses the same draw for its input
  and its output gradient, so A and G of a call describe the same examples;
* the draw is a function of the preconditioner's step, the micro-batch index and ``N`` only, so a resumed
  run draws what the uninterrupted run drew, and every rank draws the same positions of its own batch;
* A is the mean over the ``k`` examples (its count is ``k``); under ``'expand'`` and ``'per_example'``
  scaling autograd's output gradient carries ``1/N`` of the full batch, so the G sum is multiplied by
  ``(N/k)²`` to be the same mean over the ``k`` examples; under ``'kaisa'`` G is a mean over rows and needs
  no correction.

With ``fraction = 1`` nothing is drawn and the path is the exact one, bit for bit.

``factor_position_fraction`` thins out the *output positions* of a convolution instead (KFC's statistics
are sums over positions, Grosse & Martens 2016; a random subset of them estimates those sums without
bias). What the hooks do with ``fraction < 1`` for a layer whose handler has ``a_gram_rows`` (``nn.Conv2d``):

* each call draws a cyclic block of ``k = max(1, round(fraction·H_out))`` consecutive *rows* of output
  positions (every column of a drawn row): a start row ``r`` uniform in ``[0, H_out)``, the rows
  ``r, r+1, …, r+k-1`` modulo ``H_out``, so every row is drawn with probability ``k/H_out``. A run of
  consecutive output rows reads one band of input rows, so A of the block is the same exact kernel on at
  most two slices of the input, about the fraction of its cost on large maps (on small maps the fixed
  costs dominate: little gain there).
  Rows drawn independently would cost *more* than every row (one slice per row);
* A and G of the call use the same rows (G: the output gradient's rows ``index_select``-ed), so the pair
  describes the same positions;
* both sums are multiplied by ``H_out/k``, and the call keeps its full position count ``T``: every position
  is drawn with probability ``k/H_out``, so the expectation of each factor over draws is the exact factor,
  under either scaling convention (normalisation divides by the counts, which do not change);
* the draw is a function of the step, the micro-batch, the layer's name and ``H_out`` only (resume and
  ranks as above), and independent from layer to layer.

Both options compose: the positions of the drawn examples.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from .layers import Gram, LayerHandler
from .options import FactorScaling

__all__ = ["ExampleSubset", "PositionSubset", "check_fraction", "subset_size"]


def check_fraction(fraction: float, name: str = "factor_batch_fraction") -> float:
    """``fraction`` (the option ``name``) as a float in (0, 1]; a ValueError names the valid range."""
    value = float(fraction)
    if not 0.0 < value <= 1.0:
        what = "every output position" if "position" in name else "every example"
        raise ValueError(f"{name}={fraction!r} must be in (0, 1] (1 = {what}, exact)")
    return value


def subset_size(fraction: float, n: int) -> int:
    """How many of ``n`` examples (or rows of output positions) a draw at ``fraction`` takes:
    ``max(1, round(fraction·n))`` (Python's round: halves to even), at most ``n``; ``n`` means every one,
    and nothing is drawn. The one rule of both options, shared with the planner (``kfac-bench plan``)."""
    return min(n, max(1, round(fraction * n)))


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
        k = subset_size(self.fraction, n)
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
        if self.scaling is not FactorScaling.KAISA:
            return (n / k) ** 2
        return 1.0


class PositionSubset:
    """The rows of output positions each convolution call's factors are computed from (module docstring).

    Args:
        fraction: share of the rows of output positions, in (0, 1).
        steps: the preconditioner's current step count (read at each draw).
    """

    def __init__(self, fraction: float, steps: Callable[[], int]) -> None:
        self.fraction = check_fraction(fraction, "factor_position_fraction")
        self.steps = steps

    @staticmethod
    def applies(handler: LayerHandler) -> bool:
        """Whether the layer type can compute its input factor from a subset of output rows."""
        return callable(getattr(handler, "a_gram_rows", None))

    def rows(
        self, name: str, micro_batch: int, out_h: int, device: torch.device
    ) -> torch.Tensor | None:
        """Sorted indices of the output rows to use, or None for all of them (too few to thin out)."""
        k = subset_size(self.fraction, out_h)
        if k >= out_h:
            return None
        seed = (self.steps() * 1_000_003 + micro_batch * 1_009 + out_h) * 65_537 + zlib.crc32(
            name.encode()
        )
        g = torch.Generator().manual_seed(seed % 2**62)
        start = int(torch.randint(out_h, (1,), generator=g))
        return self.block(out_h, k, start).to(device)

    @staticmethod
    def block(out_h: int, k: int, start: int) -> torch.Tensor:
        """The sorted rows ``start, …, start+k-1`` modulo ``out_h``: the draw with that start row."""
        return ((torch.arange(k) + start) % out_h).sort().values

    @staticmethod
    def a_gram(
        handler: LayerHandler,
        module: nn.Module,
        x: torch.Tensor,
        dtype: torch.dtype,
        bias: bool,
        rows: torch.Tensor,
        out_h: int,
    ) -> Gram:
        """The input gram of the output rows ``rows``, scaled by ``out_h / k`` (an unbiased estimate of
        the gram of every row); its position count is that of every row."""
        gram = handler.a_gram_rows(module, x, dtype, bias, rows)  # type: ignore[attr-defined]
        k = rows.numel()
        return Gram(gram.sum.mul_(out_h / k), gram.examples, gram.positions * out_h // k)

    @staticmethod
    def g_gram(
        handler: LayerHandler,
        module: nn.Module,
        g: torch.Tensor,
        dtype: torch.dtype,
        rows: torch.Tensor,
    ) -> Gram:
        """The output-gradient gram of the output rows ``rows`` of ``g``, scaled like :meth:`a_gram`."""
        out_h, k = g.shape[-2], rows.numel()
        gram = handler.g_gram(module, g.index_select(-2, rows), dtype)
        return Gram(gram.sum.mul_(out_h / k), gram.examples, gram.positions * out_h // k)
