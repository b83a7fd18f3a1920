"""The one place where the typed K-FAC config becomes :class:`kfac_bench.kfac.KFACPreconditioner` arguments.

It sits with the schemas, below the training loop, because two callers need the same mapping: the loop
(:mod:`kfac_bench.train.build`) and the planner (:mod:`kfac_bench.plan.recipe`), which predicts a run
from the same dtypes and intervals.

Field names of :class:`~kfac_bench.config.schema.KFACConfig` are the engine's keyword names (a test keeps them
in step). Epoch-based schedules become callables of the preconditioner's step count: the epoch is
``step // steps_per_epoch`` (one ``step()`` per optimizer step), so they are plain functions, identical after
a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from enum import Enum
from typing import Any

import torch
from torch import nn

from kfac_bench.config.schema import KFACConfig
from kfac_bench.errors import ConfigError
from kfac_bench.kfac.options import DistributedStrategy, parse_grad_worker_fraction
from kfac_bench.kfac.schedules import step_decay

__all__ = ["FROM_LOOP", "HARNESS_ONLY", "build_preconditioner", "epoch_step_decay", "kfac_kwargs"]

#: KFACConfig fields the harness interprets itself (never passed to the engine).
HARNESS_ONLY = frozenset(
    {
        "enabled",
        "damping_decay_epochs",
        "damping_decay_factor",
        "update_interval_decay_epochs",
        "update_interval_decay_factor",
        "reference_world_size",
    }
)
#: Engine arguments that are not config fields: supplied by the loop, or left at the engine's default
#: (``process_group``: the world).
FROM_LOOP = frozenset({"model", "lr", "accumulation_steps", "grad_scaler", "process_group"})


def epoch_step_decay(
    base: float, milestones: list[int], factor: float, steps_per_epoch: int
) -> Callable[[int], float]:
    """``base * factor**k``, k = milestones passed by the epoch ``step // steps_per_epoch``: the engine's
    epoch schedule, read at the preconditioner's step count."""
    by_epoch = step_decay(base, [int(m) for m in milestones], factor)
    return lambda step: by_epoch(step // steps_per_epoch)


def _grad_worker_fraction(value: str) -> float | str:
    """The engine's parse (one place for the rule), its ValueError as a one-line config error."""
    try:
        parsed = parse_grad_worker_fraction(value)
    except ValueError as err:
        raise ConfigError(f"kfac.{err}") from None
    return parsed.value if isinstance(parsed, DistributedStrategy) else parsed


def torch_dtype(name: str | None, key: str) -> torch.dtype | None:
    """``kfac.<key>`` (a dtype name such as ``bfloat16``) as a torch dtype; None stays None."""
    if name is None:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"kfac.{key}={name!r} is not a torch dtype (e.g. float32, bfloat16, float64)"
        )
    return dtype


def scaled_interval(base: int, reference_world_size: int | None, world_size: int) -> int:
    """An update interval given for ``reference_world_size`` ranks, on ``world_size`` ranks: scaled by
    their ratio (at least 1), so the number of K-FAC updates per epoch stays constant as ranks are added
    (SC20 §VI-C3: 2000 at 16 GPUs ... 125 at 256). ``None``: the interval as given."""
    if reference_world_size is None:
        return base
    return max(1, round(base * reference_world_size / world_size))


def _interval(base: int, cfg: KFACConfig, world_size: int, steps_per_epoch: int) -> int | Callable:
    base = scaled_interval(base, cfg.reference_world_size, world_size)
    if not cfg.update_interval_decay_epochs:
        return base
    decay = epoch_step_decay(
        float(base),
        cfg.update_interval_decay_epochs,
        cfg.update_interval_decay_factor,
        steps_per_epoch,
    )
    return lambda step: max(1, round(decay(step)))


def kfac_kwargs(
    cfg: KFACConfig,
    *,
    steps_per_epoch: int,
    world_size: int,
    accumulation_steps: int,
    lr: float | Callable[[int], float],
    grad_scaler: Any = None,
) -> dict[str, Any]:
    """Keyword arguments of ``KFACPreconditioner`` (all but ``model``) for a run.

    Args:
        cfg: the ``kfac`` config (``enabled`` must be true).
        steps_per_epoch: optimizer steps per epoch, to turn epoch milestones into step callables.
        world_size: number of ranks (``reference_world_size`` scaling).
        accumulation_steps: micro-batches per optimizer step.
        lr: the current LR (a callable of the step), used by the KL clip.
        grad_scaler: the AMP ``GradScaler`` or None.
    """
    kwargs: dict[str, Any] = {}
    for f in fields(KFACConfig):
        if f.name in HARNESS_ONLY:
            continue
        value = getattr(cfg, f.name)
        kwargs[f.name] = value.value if isinstance(value, Enum) else value
    kwargs["skip_layers"] = list(cfg.skip_layers)
    kwargs["batch_dim"] = {str(k): int(v) for k, v in cfg.batch_dim.items()} or None
    kwargs["grad_worker_fraction"] = _grad_worker_fraction(cfg.grad_worker_fraction)
    for key in ("factor_dtype", "inv_dtype", "comm_dtype"):
        kwargs[key] = torch_dtype(kwargs[key], key)
    kwargs["factor_update_steps"] = _interval(
        cfg.factor_update_steps, cfg, world_size, steps_per_epoch
    )
    kwargs["inv_update_steps"] = _interval(cfg.inv_update_steps, cfg, world_size, steps_per_epoch)
    if cfg.damping_decay_epochs:
        kwargs["damping"] = epoch_step_decay(
            cfg.damping, cfg.damping_decay_epochs, cfg.damping_decay_factor, steps_per_epoch
        )
    kwargs.update(accumulation_steps=accumulation_steps, lr=lr, grad_scaler=grad_scaler)
    return kwargs


def build_preconditioner(model: nn.Module, cfg: KFACConfig, **run: Any) -> Any | None:
    """The engine's preconditioner for ``model`` (the module DDP wraps, not the wrapper), or None when
    K-FAC is off. ``run`` is passed to :func:`kfac_kwargs`. Layer types of third-party libraries
    (:mod:`kfac_bench.models.layer_types`) are registered first; ``precond.coverage()`` says what it
    covers."""
    if not cfg.enabled:
        return None
    from kfac_bench.kfac import KFACPreconditioner
    from kfac_bench.models.layer_types import register_harness_layer_types

    register_harness_layer_types()
    return KFACPreconditioner(model, **kfac_kwargs(cfg, **run))
