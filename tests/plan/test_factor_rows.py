"""The planner's factor computation under ``factor_batch_fraction`` / ``factor_position_fraction``: the rows
the engine's hooks use, nothing else of the plan changed (the factors keep their size, so memory and
communication do not move)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kfac_bench.kfac import Conv2dHandler, KFACPreconditioner, LinearHandler, scan_model
from kfac_bench.models.small_cnn import build_small_cnn
from kfac_bench.plan.config import PlanConfig
from kfac_bench.plan.recipe import load_recipe
from kfac_bench.plan.report import build_plan, render
from kfac_bench.plan.timing import NOMINAL_V100

BATCH = 256  # recipes/digits.yaml's train.batch_size: one micro-batch per rank
SIDE = 8  # digits images and the SmallCNN's convolution outputs (3x3, padding 1) are 8x8
CASES = [(0.25, 1.0), (0.3, 1.0), (1.0, 0.3), (0.3, 0.6), (0.001, 0.01)]


def _plan(batch_fraction: float, position_fraction: float, out: Path) -> dict[str, Any]:
    planned = load_recipe(
        [
            "+recipe=digits",
            f"kfac.factor_batch_fraction={batch_fraction}",
            f"kfac.factor_position_fraction={position_fraction}",
        ]
    )
    return build_plan(planned, PlanConfig(world_sizes=[1, 4], out=str(out)), NOMINAL_V100)


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _plan(1.0, 1.0, tmp_path_factory.mktemp("exact"))


def _kept(fraction: float, n: int) -> int:
    """k of n at ``fraction``, as the engine's docstring states it (no case here rounds a half)."""
    return min(n, max(1, round(fraction * n)))


def _expected_flops(batch_fraction: float, position_fraction: float) -> tuple[float, float]:
    """(used, every row) flops of one micro-batch of the digits CNN, from its layer shapes."""
    layers = scan_model(build_small_cnn()).layers
    used = every = 0.0
    examples = _kept(batch_fraction, BATCH)
    for s in layers:
        d2 = s.a_dim**2 + s.g_dim**2
        if s.type == "Conv2d":
            every += 2 * BATCH * SIDE * SIDE * d2
            used += 2 * examples * _kept(position_fraction, SIDE) * SIDE * d2
        else:  # one position per example
            every += 2 * BATCH * d2
            used += 2 * examples * d2
    return used, every


#: What thinned rows change in memory: they take the engine's per-call path, where each call holds its
#: input factor until its gradient (the batched path holds none).
PER_CALL_MEMORY = ("batch_buffers", "buffers", "total")


def _without_factor_stage(plan: dict[str, Any]) -> dict[str, Any]:
    plan = copy.deepcopy(plan)
    del plan["factor_computation"]
    for key in ("factor_batch_fraction", "factor_position_fraction"):
        del plan["settings"][key]
    for row in plan["rows"]:
        for key in ("factor_computation", "factor_computation_per_step"):
            del row["seconds"][key]
        for key in PER_CALL_MEMORY:
            del row["memory_bytes_per_rank"][key]
    return plan


@pytest.mark.parametrize(("batch_fraction", "position_fraction"), CASES)
def test_factor_cost_scales_by_the_rows_the_engine_keeps(
    exact: dict[str, Any], batch_fraction: float, position_fraction: float, tmp_path: Path
) -> None:
    plan = _plan(batch_fraction, position_fraction, tmp_path)
    used, every = _expected_flops(batch_fraction, position_fraction)
    for full, thin in zip(
        exact["factor_computation"]["per_world_size"],
        plan["factor_computation"]["per_world_size"],
        strict=True,
    ):
        assert full["micro_batches"] == thin["micro_batches"] == 1
        assert full["flops_per_factor_step"] == pytest.approx(every, rel=1e-12)
        assert thin["flops_per_factor_step"] == pytest.approx(used, rel=1e-12)
        assert thin["seconds_per_factor_step"] / full["seconds_per_factor_step"] == pytest.approx(
            used / every, rel=1e-12
        )
    for full_row, thin_row in zip(exact["rows"], plan["rows"], strict=True):
        ratio = (
            thin_row["seconds"]["factor_computation"] / full_row["seconds"]["factor_computation"]
        )
        assert ratio == pytest.approx(used / every, rel=1e-12)
    # Everything else, every collective's bytes included, is the exact plan's; the buffers are no less
    # (more at their peak where it comes before the gradients arrive).
    assert _without_factor_stage(plan) == _without_factor_stage(exact)
    more = 0
    for full_row, thin_row in zip(exact["rows"], plan["rows"], strict=True):
        for key in PER_CALL_MEMORY:
            full, thin = (r["memory_bytes_per_rank"][key] for r in (full_row, thin_row))
            assert thin["min"] >= full["min"] and thin["max"] >= full["max"], key
            more += thin["max"] > full["max"]
    assert more
    assert plan["settings"]["factor_batch_fraction"] == batch_fraction
    assert plan["settings"]["factor_position_fraction"] == position_fraction
    text = render(plan)
    assert (
        f"factor_batch_fraction={batch_fraction:g}, factor_position_fraction={position_fraction:g}"
        in text
    )
    assert f"factor computation {used / every:.3g}x that of every row" in text
    assert "GFLOP per factor step" in text


def test_the_planned_rows_are_those_the_engine_computes_factors_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One factor step of the real engine on the digits CNN: the rows of every A and G product it computes
    (examples × positions of the grams its handlers return) are the planner's rows, call by call."""
    batch_fraction, position_fraction = 0.3, 0.4
    seen: dict[tuple[str, str], int] = {}

    def recording(cls: type, method: str, kind: str) -> None:
        original = getattr(cls, method)

        def wrapper(self: Any, module: torch.nn.Module, *args: Any) -> Any:
            gram = original(self, module, *args)
            key = (type(module).__name__ + str(module.weight.shape[:2]), kind)
            seen[key] = seen.get(key, 0) + gram.examples * gram.positions
            return gram

        monkeypatch.setattr(cls, method, wrapper)

    for cls in (Conv2dHandler, LinearHandler):
        recording(cls, "a_gram", "A")
        recording(cls, "g_gram", "G")
    recording(Conv2dHandler, "a_gram_rows", "A")

    torch.manual_seed(0)
    model = build_small_cnn()
    precond = KFACPreconditioner(
        model,
        factor_batch_fraction=batch_fraction,
        factor_position_fraction=position_fraction,
    )
    x, y = torch.randn(BATCH, 1, SIDE, SIDE), torch.randint(0, 10, (BATCH,))
    F.cross_entropy(model(x), y).backward()
    precond.step()

    plan = _plan(batch_fraction, position_fraction, tmp_path)
    calls = plan["factor_computation"]["calls"]
    planned = load_recipe(["+recipe=digits"]).layers
    by_name = {s.name: s for s in planned}
    for call in calls:
        module = by_name[call["name"]].module
        key = type(module).__name__ + str(module.weight.shape[:2])
        rows = call["examples_used"] * call["positions_used"]
        assert seen.pop((key, "A")) == rows, call["name"]
        assert seen.pop((key, "G")) == rows, call["name"]
    assert not seen  # every product the engine computed was planned
