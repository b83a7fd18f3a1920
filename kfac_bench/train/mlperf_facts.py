"""The header of a run's ``mlperf.log`` (:class:`kfac_bench.metrics.mlperf.RunFacts`) from its composed
config: the hyperparameters under MLPerf's keys (``mlperf_logging.mllog.constants``), stated as the run
uses them.

Keys are logged where the run has the quantity the key names: SGD's and LAMB's settings, the warm-up and the
step decay of ``warmup_multistep``, the polynomial decay of ``polynomial``, Mask R-CNN's image sizes and
region proposals. The closed-division rules of mlperf-logging's ``training_3.1.0`` ask for these (and fix
some of their values); a key whose quantity the run does not have (ResNet-50's polynomial-decay end rate
under the paper's step decay) is left out rather than invented. The K-FAC settings go under ``kfac``, which
MLPerf does not define (the checker ignores unknown keys).
"""

from __future__ import annotations

from typing import Any

import torch

from kfac_bench.config.schema import (
    OptimizerName,
    RunConfig,
    ScheduleName,
    ScheduleUnit,
    WarmupMethod,
)
from kfac_bench.data.base import DataSplits
from kfac_bench.data.batching import BatchLayout
from kfac_bench.metrics.mlperf import RunFacts
from kfac_bench.train.optim import base_lr, schedule_steps

__all__ = ["run_facts"]


def run_facts(
    cfg: RunConfig,
    *,
    batches: BatchLayout,
    splits: DataSplits,
    max_steps: int,
    world_size: int,
    device: torch.device,
    primary: str,
    init_start_s: float,
    starting_world_size: int | None = None,
) -> RunFacts:
    """What ``mlperf.log``'s header states for the run ``cfg`` (see the module docstring) on ``world_size``
    ranks; its hyperparameters are those of ``starting_world_size`` (default ``world_size``), the world the
    run started with."""
    t = cfg.train
    eval_batch = t.eval_batch_size or t.batch_size
    eval_samples = len(splits.val)  # type: ignore[arg-type]
    if t.limit_eval_batches is not None:
        eval_samples = min(eval_samples, t.limit_eval_batches * eval_batch * world_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return RunFacts(
        benchmark=str(t.benchmark_name),
        platform=f"{world_size}x{name}",
        init_start_s=init_start_s,
        train_samples=len(splits.train),  # type: ignore[arg-type]
        eval_samples=eval_samples,
        targets=dict(t.targets),
        primary=primary,
        hyperparameters=hyperparameters(cfg, batches, max_steps, starting_world_size or world_size),
    )


def hyperparameters(
    cfg: RunConfig, batches: BatchLayout, max_steps: int, world_size: int
) -> dict[str, Any]:
    """MLPerf key -> value for the run's batch, optimizer, schedule, model and K-FAC settings."""
    t, o, s = cfg.train, cfg.optimizer, cfg.lr_schedule
    lr = base_lr(o, world_size)
    hp: dict[str, Any] = {
        "global_batch_size": batches.global_batch,
        "gradient_accumulation_steps": batches.accumulation_steps,
        "seed": t.seed,
        "opt_name": str(OptimizerName(o.name).value),
        "opt_base_learning_rate": lr,
    }
    name = OptimizerName(o.name)
    if name is OptimizerName.sgd:
        hp.update(
            sgd_opt_base_learning_rate=lr,
            sgd_opt_momentum=o.momentum,
            sgd_opt_weight_decay=o.weight_decay,
            opt_weight_decay=o.weight_decay,
        )
    elif name is OptimizerName.lamb:
        hp.update(
            opt_lamb_beta_1=o.betas[0],
            opt_lamb_beta_2=o.betas[1],
            opt_lamb_epsilon=o.eps,
            opt_lamb_weight_decay_rate=o.weight_decay,
        )
    else:
        hp.update(opt_adamw_beta_1=o.betas[0], opt_adamw_beta_2=o.betas[1], opt_adamw_epsilon=o.eps)
        hp["opt_adamw_weight_decay"] = o.weight_decay
    hp.update(_schedule(s, batches.steps_per_epoch, max_steps, world_size))
    if t.benchmark_name == "resnet":
        hp["model_bn_span"] = t.batch_size  # batch norm statistics over each process's micro-batch
    model = cfg.model
    for ours, mlperf in (
        ("min_size", "min_image_size"),
        ("max_size", "max_image_size"),
        ("rpn_post_nms_top_n_train", "num_image_candidates"),
    ):
        if ours in model:
            hp[mlperf] = model[ours]
    k = cfg.kfac
    hp["kfac"] = (
        {
            "grad_worker_fraction": str(k.grad_worker_fraction),
            "factor_update_steps": k.factor_update_steps,
            "inv_update_steps": k.inv_update_steps,
            "damping": k.damping,
            "factor_decay": k.factor_decay,
            "kl_clip": k.kl_clip,
        }
        if k.enabled
        else None
    )
    return hp


def _schedule(s: Any, steps_per_epoch: int, max_steps: int, world_size: int) -> dict[str, Any]:
    warmup, milestones, total = schedule_steps(s, steps_per_epoch, max_steps)
    hp: dict[str, Any] = {
        "opt_learning_rate_training_steps": max_steps,
        "opt_learning_rate_warmup_steps": round(warmup),
        "num_warmup_steps": round(warmup),
        "start_warmup_step": 0,
    }
    if ScheduleUnit(s.unit) is ScheduleUnit.epochs:
        hp["opt_learning_rate_warmup_epochs"] = s.warmup
    if WarmupMethod(s.warmup_method) is WarmupMethod.mlperf_linear:
        hp["opt_learning_rate_warmup_factor"] = s.warmup_factor
    else:
        start = s.warmup_start_factor if s.warmup_start_factor is not None else 1.0 / world_size
        hp["opt_learning_rate_warmup_factor"] = start
    kind = ScheduleName(s.name)
    if kind is ScheduleName.warmup_multistep:
        hp["opt_learning_rate_decay_factor"] = s.gamma
        hp["opt_learning_rate_decay_steps"] = [round(m) for m in milestones]
        if ScheduleUnit(s.unit) is ScheduleUnit.epochs:
            hp["opt_learning_rate_decay_boundary_epochs"] = list(s.milestones)
    elif kind is ScheduleName.polynomial:
        hp["opt_learning_rate_decay_poly_power"] = s.power
        hp["opt_learning_rate_decay_steps"] = round(total)
    return hp
