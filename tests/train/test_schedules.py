"""LR schedules and K-FAC schedules are plain functions of progress with the documented shapes."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from kfac_bench.config.kfac_adapter import epoch_step_decay, kfac_kwargs
from kfac_bench.config.schema import KFACConfig, LRScheduleConfig
from kfac_bench.errors import ConfigError
from kfac_bench.train.optim import build_optimizer, lr_factor


def sched(**kw: object) -> LRScheduleConfig:
    return OmegaConf.structured(LRScheduleConfig(**kw))  # type: ignore[arg-type]


def test_paper_warmup_multistep_from_lr_over_n() -> None:
    # 4 workers, 5 warm-up epochs of 10 steps, x0.1 at epochs 35 and 75 (the CIFAR arm's shape).
    f = lr_factor(
        sched(warmup=5, milestones=[35, 75]), steps_per_epoch=10, total_steps=1000, world_size=4
    )
    assert f(0) == pytest.approx(0.25)  # LR/N: the single-worker rate
    assert f(25) == pytest.approx(0.25 + 0.75 * 25 / 50)
    assert f(50) == pytest.approx(1.0) and f(349) == pytest.approx(1.0)
    assert (
        f(350) == pytest.approx(0.1)
        and f(749) == pytest.approx(0.1)
        and f(750) == pytest.approx(0.01)
    )


def test_schedule_is_a_plain_function_of_the_step() -> None:
    f = lr_factor(sched(warmup=1, milestones=[2]), steps_per_epoch=4, total_steps=40)
    first = [f(s) for s in range(40)]
    assert [f(s) for s in range(40)] == first  # no hidden state: resuming at any step is exact


def test_polynomial_with_fractional_warmup() -> None:
    cfg = sched(name="polynomial", unit="fraction", warmup=0.25, warmup_start_factor=0.0, power=0.5)
    f = lr_factor(cfg, steps_per_epoch=7, total_steps=100)
    assert f(0) == 0.0 and f(25) == pytest.approx(1.0)
    assert f(100) == pytest.approx(0.0)
    assert f(62) == pytest.approx(math.sqrt(1 - 37 / 75))


def test_cosine_and_steps_unit() -> None:
    f = lr_factor(
        sched(name="cosine", unit="steps", min_factor=0.1), steps_per_epoch=3, total_steps=20
    )
    assert (
        f(0) == pytest.approx(1.0) and f(10) == pytest.approx(0.55) and f(20) == pytest.approx(0.1)
    )
    g = lr_factor(
        sched(unit="steps", warmup=0, milestones=[5]), steps_per_epoch=100, total_steps=10
    )
    assert g(4) == 1.0 and g(5) == pytest.approx(0.1)


def test_mlperf_linear_warmup_is_an_absolute_slope() -> None:
    # maskrcnn_benchmark's WarmupMultiStepLR, mlperf_linear: lr(t) = (lr - (W - t) * factor) * gamma^k,
    # here lr 0.5, W 10 steps, factor 0.02, a milestone inside the warm-up (at 5) and one after (at 20).
    cfg = sched(
        unit="steps",
        warmup=10,
        warmup_method="mlperf_linear",
        warmup_factor=0.02,
        milestones=[5, 20],
    )
    f = lr_factor(cfg, steps_per_epoch=100, total_steps=100, base_lr=0.5)
    expected = [(0.5 - (10 - t) * 0.02) * (0.1 if t >= 5 else 1.0) for t in range(10)]
    assert [0.5 * f(t) for t in range(10)] == pytest.approx(expected)
    assert 0.5 * f(10) == pytest.approx(0.05) and 0.5 * f(20) == pytest.approx(0.005)
    with pytest.raises(ConfigError, match="must not be negative"):
        lr_factor(cfg, steps_per_epoch=100, total_steps=100, base_lr=0.1)  # 0.1 - 10 x 0.02 < 0
    with pytest.raises(ConfigError, match="positive base LR"):
        lr_factor(cfg, steps_per_epoch=100, total_steps=100)


def test_damping_decay_does_not_compound() -> None:
    damping = epoch_step_decay(0.003, [2, 4], 0.5, steps_per_epoch=10)
    assert [damping(s) for s in (0, 19, 20, 39, 40, 400)] == pytest.approx(
        [0.003, 0.003, 0.0015, 0.0015, 0.00075, 0.00075]
    )
    assert damping(25) == damping(
        25
    )  # the reference scheduler shrinks on every call after a milestone


def _kfac(**kw: object) -> KFACConfig:
    return OmegaConf.structured(KFACConfig(**kw))  # type: ignore[arg-type]


def test_adapter_builds_callables_for_epoch_schedules() -> None:
    cfg = _kfac(
        factor_update_steps=1,
        inv_update_steps=10,
        damping_decay_epochs=[3],
        update_interval_decay_epochs=[2],
        update_interval_decay_factor=10,
    )
    kw = kfac_kwargs(cfg, steps_per_epoch=5, world_size=1, accumulation_steps=2, lr=0.1)
    assert kw["damping"](14) == pytest.approx(0.003) and kw["damping"](15) == pytest.approx(0.0015)
    assert kw["inv_update_steps"](9) == 10 and kw["inv_update_steps"](10) == 100
    assert kw["factor_update_steps"](10) == 10
    assert kw["accumulation_steps"] == 2 and kw["compute_method"] == "eigen"
    assert kw["grad_worker_fraction"] == "comm_opt" and kw["kl_clip"] == 0.001


def test_intervals_scale_with_world_size_from_a_reference() -> None:
    # The paper's ResNet-50 rule: 2000 at 16 GPUs, 1000 at 32, ..., 125 at 256.
    cfg = _kfac(inv_update_steps=2000, factor_update_steps=200, reference_world_size=16)
    for world, expected in [(16, 2000), (32, 1000), (64, 500), (128, 250), (256, 125)]:
        kw = kfac_kwargs(cfg, steps_per_epoch=100, world_size=world, accumulation_steps=1, lr=0.1)
        assert kw["inv_update_steps"] == expected
    kw = kfac_kwargs(cfg, steps_per_epoch=100, world_size=4096, accumulation_steps=1, lr=0.1)
    assert kw["inv_update_steps"] >= 1 and kw["factor_update_steps"] >= 1


@pytest.mark.parametrize(("value", "expected"), [("0.5", 0.5), ("mem_opt", "mem_opt"), ("1", 1.0)])
def test_grad_worker_fraction_accepts_numbers_and_strategy_names(
    value: str, expected: object
) -> None:
    kw = kfac_kwargs(
        _kfac(grad_worker_fraction=value),
        steps_per_epoch=1,
        world_size=2,
        accumulation_steps=1,
        lr=0.1,
    )
    assert kw["grad_worker_fraction"] == expected


@pytest.mark.parametrize("value", ["0", "1.5", "fast"])
def test_bad_grad_worker_fraction_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="grad_worker_fraction"):
        kfac_kwargs(
            _kfac(grad_worker_fraction=value),
            steps_per_epoch=1,
            world_size=2,
            accumulation_steps=1,
            lr=0.1,
        )


def test_dtype_names_become_torch_dtypes() -> None:
    kw = kfac_kwargs(
        _kfac(factor_dtype="bfloat16"), steps_per_epoch=1, world_size=1, accumulation_steps=1, lr=1
    )
    assert kw["factor_dtype"] is torch.bfloat16 and kw["inv_dtype"] is None
    with pytest.raises(ConfigError, match="inv_dtype"):
        kfac_kwargs(
            _kfac(inv_dtype="float7"), steps_per_epoch=1, world_size=1, accumulation_steps=1, lr=1
        )


def test_optimizers_and_linear_scaling() -> None:
    from kfac_bench.config.schema import OptimizerConfig

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    for name in ("sgd", "adamw", "lamb"):
        cfg = OmegaConf.structured(
            OptimizerConfig(name=name, lr=0.1, scale_lr_with_world_size=True)
        )
        opt = build_optimizer(model, cfg, world_size=8)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.8)
    cfg = OmegaConf.structured(
        OptimizerConfig(name="lamb", weight_decay=0.01, no_decay_bias_and_norm=True)
    )
    groups = build_optimizer(model, cfg).param_groups
    assert [len(g["params"]) for g in groups] == [1, 3] and groups[1]["weight_decay"] == 0.0
    assert type(
        build_optimizer(model, OmegaConf.structured(OptimizerConfig(name="lamb")))
    ).__module__.startswith("timm")
