"""The factor stage per rank: the rows each layer's factor products use, by the engine's subset rules.

Every rank computes every layer's A and G from its own micro-batches (every strategy alike), so the factor
computation is one figure per world size. Its size is ``2·rows·d²`` flops per factor (the GEMM floor
of ``benchmarks/overhead.py``; the conv A kernel never builds the patches but does this much work), with
``rows`` = examples × output positions of one call of the layer. ``factor_batch_fraction`` and
``factor_position_fraction`` thin out those rows exactly as the engine's hooks do
(:mod:`kfac_bench.kfac.subsample`, :func:`~kfac_bench.kfac.subsample.subset_size` for both counts): the
factors keep their size, so memory and communication do not change.

The positions come from one forward pass of the full-size model on the meta device (shapes, no memory) on a
micro-batch of the dataset's input shape, where the config states it (image sizes, sequence lengths); a
dataset whose shapes are known only from its files (COCO's image sizes, the length the BERT shards were
prepared with) leaves the factor computation unplanned, with the reason in the report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kfac_bench.kfac import LayerSpec
from kfac_bench.kfac.subsample import PositionSubset, subset_size

__all__ = ["FactorCalls", "LayerCall", "factor_calls", "model_input"]

_META = torch.device("meta")


@dataclass(frozen=True)
class LayerCall:
    """One call of a K-FAC layer on one micro-batch, and the rows its factor products use.

    Attributes:
        name: the layer.
        examples, positions: of the call (positions: per example; a convolution's ``out_h·out_w``).
        examples_used, positions_used: what the engine's factor hooks keep of them.
        a_dim, g_dim: the factor sizes.
    """

    name: str
    examples: int
    positions: int
    examples_used: int
    positions_used: int
    a_dim: int
    g_dim: int

    @property
    def rows(self) -> int:
        return self.examples * self.positions

    @property
    def rows_used(self) -> int:
        return self.examples_used * self.positions_used

    @property
    def flops(self) -> float:
        """Flops of this call's A and G products (``2·rows·d²`` each)."""
        return 2.0 * self.rows_used * (self.a_dim**2 + self.g_dim**2)

    @property
    def exact_flops(self) -> float:
        """Flops of the products over every row (both fractions 1)."""
        return 2.0 * self.rows * (self.a_dim**2 + self.g_dim**2)


@dataclass(frozen=True)
class FactorCalls:
    """The factor stage of one micro-batch on one rank: its layer calls, or why it is not planned."""

    batch_fraction: float
    position_fraction: float
    calls: tuple[LayerCall, ...] = ()
    input_shape: str | None = None
    reason: str | None = None

    def flops(self, micro_batches: int) -> float | None:
        """Factor flops per rank of one factor step of ``micro_batches`` micro-batches (None: unplanned)."""
        if self.reason is not None:
            return None
        return micro_batches * sum(c.flops for c in self.calls)

    def to_dict(self) -> dict[str, Any]:
        return {
            "factor_batch_fraction": self.batch_fraction,
            "factor_position_fraction": self.position_fraction,
            "input": self.input_shape,
            "reason": self.reason,
            "calls": [
                {
                    "name": c.name,
                    "examples": c.examples,
                    "positions": c.positions,
                    "examples_used": c.examples_used,
                    "positions_used": c.positions_used,
                    "flops": c.flops,
                    "exact_flops": c.exact_flops,
                }
                for c in self.calls
            ],
        }


def _images(channels: int, size: Callable[[Any], int]) -> Callable[[Any, int], Any]:
    def make(dataset: Any, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        s = size(dataset)
        return (torch.empty(batch, channels, s, s, device=_META),), {}

    return make


def _tokens(dataset: Any, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = (batch, int(dataset.max_seq_length))
    ids = torch.zeros(shape, dtype=torch.long, device=_META)
    # No attention mask: building it reads values (not on the meta device), and no layer's shape needs it.
    return (), {"input_ids": ids, "token_type_ids": ids}


#: Dataset builders whose config states the model's input shape: builder -> (dataset config, micro-batch)
#: -> model arguments on the meta device.
INPUTS: dict[str, Callable[[Any, int], Any]] = {
    "kfac_bench.data.digits.build_digits": _images(1, lambda d: 8),
    "kfac_bench.data.cifar.build_cifar10": _images(3, lambda d: 32),
    "kfac_bench.data.cifar.build_tiny_cifar10": _images(3, lambda d: 32),
    "kfac_bench.data.imagenet.build_imagenet": _images(3, lambda d: int(d.image_size)),
    "kfac_bench.data.imagenet.build_tiny_imagenet": _images(3, lambda d: int(d.image_size)),
    "kfac_bench.data.bert_smoke.build_bert_pydoc": _tokens,
    "kfac_bench.data.squad.load_squad_splits": _tokens,
    "kfac_bench.data.squad_smoke.build_squad_pydoc": _tokens,
}


def model_input(dataset: Any, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]] | str:
    """The model's arguments for a micro-batch of ``batch`` examples of ``dataset`` (a config node with
    ``_target_``) on the meta device, or why the config does not say their shape."""
    target = str(dataset.get("_target_", ""))
    make = INPUTS.get(target)
    if make is None:
        return f"the input shapes of {target.rsplit('.', 1)[-1]} are known only from its files"
    return make(dataset, batch)


def factor_calls(
    model: nn.Module,
    layers: list[LayerSpec],
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | str,
    batch_fraction: float = 1.0,
    position_fraction: float = 1.0,
) -> FactorCalls:
    """The factor rows of each call of ``layers`` in one forward pass of ``model`` (on the meta device) on
    ``inputs`` (from :func:`model_input`), thinned out as the engine's hooks thin them out."""
    if isinstance(inputs, str):
        return FactorCalls(batch_fraction, position_fraction, reason=inputs)
    args, kwargs = inputs
    seen: list[LayerCall] = []
    handles = [
        s.module.register_forward_hook(_recorder(s, seen, batch_fraction, position_fraction))
        for s in layers
    ]
    was_training = model.training
    try:
        model.train()
        with torch.no_grad():
            model(*args, **kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        return FactorCalls(
            batch_fraction, position_fraction, reason=f"the meta forward pass failed: {first}"
        )
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    shape = " ".join(
        f"{k}={tuple(v.shape)}"
        for k, v in [*enumerate(args), *kwargs.items()]
        if hasattr(v, "shape")
    )
    return FactorCalls(batch_fraction, position_fraction, tuple(seen), shape)


def _recorder(
    spec: LayerSpec, seen: list[LayerCall], batch_fraction: float, position_fraction: float
) -> Callable[..., None]:
    """A forward hook recording ``spec``'s calls with the rows the engine's capture would keep
    (:class:`kfac_bench.kfac.capture.Capture`: the example draw, then the position rows)."""
    spatial = spec.handler.spatial
    by_rows = PositionSubset.applies(spec.handler)

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if (
            not args
            or not isinstance(args[0], torch.Tensor)
            or not isinstance(output, torch.Tensor)
        ):
            return
        x = args[0].movedim(spec.batch_dim, 0) if spec.batch_dim else args[0]
        if x.dim() < 2 or (spatial and x.dim() < 4):  # one example: nothing to draw
            n, k = 1, 1
        else:
            n = x.shape[0]
            k = subset_size(batch_fraction, n)
        positions = output.numel() // (n * spec.g_dim)
        used = positions
        if by_rows and output.dim() >= 3:
            out_h = output.shape[-2]
            used = positions // out_h * subset_size(position_fraction, out_h)
        seen.append(LayerCall(spec.name, n, positions, k, used, spec.a_dim, spec.g_dim))

    return hook
