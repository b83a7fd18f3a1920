"""Optimizers and LR schedules built from the typed config.

The LR schedule is a plain function of training progress (:func:`lr_factor`) wrapped in a ``LambdaLR`` that
the loop steps once per optimizer step, so warm-up and decays are smooth and resume exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kfac_bench.config.schema import (
    LRScheduleConfig,
    OptimizerConfig,
    OptimizerName,
    ScheduleName,
    ScheduleUnit,
    WarmupMethod,
)
from kfac_bench.errors import ConfigError

__all__ = ["base_lr", "build_lr_scheduler", "build_optimizer", "lr_factor", "schedule_steps"]


def base_lr(cfg: OptimizerConfig, world_size: int) -> float:
    """The run's base LR: ``lr``, times the world size under the linear scaling rule."""
    return cfg.lr * (world_size if cfg.scale_lr_with_world_size else 1)


def _param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict[str, Any]]:
    if not cfg.no_decay_bias_and_norm:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    # Tied weights (BERT's MLM decoder is the word embedding) go in one group, once.
    seen: set[int] = set()
    for module in model.modules():
        norm = isinstance(module, nn.modules.batchnorm._NormBase | nn.LayerNorm | nn.GroupNorm)
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                (no_decay if norm or name == "bias" else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, world_size: int = 1
) -> torch.optim.Optimizer:
    """SGD (momentum, Nesterov), AdamW or LAMB (``timm.optim.Lamb``) over the model's trainable parameters."""
    lr = base_lr(cfg, world_size)
    groups = _param_groups(model, cfg)
    name = OptimizerName(cfg.name)
    if name is OptimizerName.sgd:
        return torch.optim.SGD(
            groups,
            lr=lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if name is OptimizerName.adamw:
        return torch.optim.AdamW(
            groups, lr=lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    from timm.optim import Lamb

    return Lamb(groups, lr=lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_factor(
    cfg: LRScheduleConfig,
    steps_per_epoch: int,
    total_steps: int,
    world_size: int = 1,
    base_lr: float | None = None,
) -> Callable[[int], float]:
    """The LR multiplier as a function of the number of completed optimizer steps.

    Args:
        cfg: the schedule; its numbers count ``cfg.unit`` (epochs, steps, or a fraction of ``total_steps``).
        steps_per_epoch: optimizer steps in one epoch (after accumulation).
        total_steps: optimizer steps of the whole run (``total`` defaults to it).
        world_size: the number of ranks (for the default warm-up start ``1 / world_size``).
        base_lr: the rate the multiplier applies to (:func:`base_lr`); needed by ``mlperf_linear``, whose
            warm-up slope is in LR units.

    Raises:
        ConfigError: a schedule that cannot be computed (no length, or an ``mlperf_linear`` warm-up that
            would start below zero).
    """
    warmup, milestones, total = schedule_steps(cfg, steps_per_epoch, total_steps)
    start = cfg.warmup_start_factor if cfg.warmup_start_factor is not None else 1.0 / world_size
    name = ScheduleName(cfg.name)
    if total <= 0:
        raise ConfigError(f"lr_schedule.total must be positive, got {total} steps")
    slope = _mlperf_slope(cfg, warmup, base_lr)

    def decay(t: float) -> float:
        if name is ScheduleName.warmup_multistep:
            return cfg.gamma ** sum(1 for m in milestones if t >= m)
        origin = 0.0 if cfg.decay_from_start else warmup
        progress = min(max((t - origin) / max(total - origin, 1.0), 0.0), 1.0)
        if name is ScheduleName.polynomial:
            return cfg.min_factor + (1 - cfg.min_factor) * (1 - progress) ** cfg.power
        if name is ScheduleName.cosine:
            return cfg.min_factor + (1 - cfg.min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    def factor(step: int) -> float:
        # step counts completed optimizer steps; the rate used by step `step` (0-based) is factor(step).
        if step < warmup:
            if slope is not None:
                # WarmupMultiStepLR's mlperf_linear: (base_lr - (warmup - t) * warmup_factor) * decay.
                return (1.0 - (warmup - step) * slope) * decay(float(step))
            return start + (1.0 - start) * step / warmup
        return decay(float(step))

    return factor


def schedule_steps(
    cfg: LRScheduleConfig, steps_per_epoch: int, total_steps: int
) -> tuple[float, list[float], float]:
    """The schedule's warm-up, milestones and length in optimizer steps (``cfg.unit`` converted)."""
    per_unit = {
        ScheduleUnit.epochs: float(steps_per_epoch),
        ScheduleUnit.steps: 1.0,
        ScheduleUnit.fraction: float(total_steps),
    }[ScheduleUnit(cfg.unit)]
    total = cfg.total * per_unit if cfg.total is not None else float(total_steps)
    return cfg.warmup * per_unit, sorted(m * per_unit for m in cfg.milestones), total


def _mlperf_slope(cfg: LRScheduleConfig, warmup: float, base_lr: float | None) -> float | None:
    """``warmup_factor / base_lr`` for an ``mlperf_linear`` warm-up (the multiplier's slope), else None."""
    if WarmupMethod(cfg.warmup_method) is not WarmupMethod.mlperf_linear:
        return None
    if base_lr is None or base_lr <= 0:
        raise ConfigError(
            "lr_schedule.warmup_method=mlperf_linear needs a positive base LR (optimizer.lr), "
            f"got {base_lr}"
        )
    if cfg.warmup_factor <= 0 or warmup * cfg.warmup_factor > base_lr * (1 + 1e-9):
        raise ConfigError(
            f"lr_schedule.warmup_factor={cfg.warmup_factor} with warmup_method=mlperf_linear must be in "
            f"(0, LR / warm-up steps] = (0, {base_lr / max(warmup, 1.0):.6g}]: the rate starts at "
            f"LR - {warmup:g} x warmup_factor and must not be negative"
        )
    return cfg.warmup_factor / base_lr


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, factor: Callable[[int], float]
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` with ``factor``; step it once after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def trainable(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if p.requires_grad]
