"""The op-count instrument (``benchmarks/ops.py``): what it counts and how it attributes ops to stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import ops
from benchmarks.training_step import classification
from kfac_bench.kfac import KFACPreconditioner, batching
from kfac_bench.kfac.layers import conv_batched


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_views_and_allocations_are_not_compute_ops() -> None:
    for op in ("view", "transpose", "expand", "slice", "to", "reshape", "contiguous", "empty"):
        assert not ops.counted(f"aten::{op}"), op
    for op in ("mm", "copy_", "add_", "fill_", "linalg_eigh", "_foreach_mul_"):
        assert ops.counted(f"aten::{op}"), op


def test_counts_leaf_ops_once_and_foreach_as_one() -> None:
    xs = [torch.randn(8, 8) for _ in range(5)]
    with torch.profiler.profile() as prof:
        a = xs[0] @ xs[1]  # matmul -> mm: one op
        a.t().contiguous()  # a transpose (view) and its copy: one op
        torch._foreach_mul_(xs, 2.0)  # one op, not five
    rows, names = ops.count_ops(list(prof.events()))
    assert names["mm"] == 1 and names["_foreach_mul_"] == 1 and names["mul_"] == 0
    assert names["copy_"] == 1 and sum(rows.values()) == sum(names.values()) == 3
    assert rows["model + SGD"] == 3


def test_in_place_metadata_changes_are_not_compute_ops() -> None:
    # kfac-pytorch's conv patches: two unfolds and two in-place transposes (new strides, no data moved),
    # then the one copy that moves data.
    x = torch.randn(2, 3, 6, 6)
    with torch.profiler.profile() as prof:
        p = x.unfold(2, 3, 1).unfold(3, 3, 1)
        p.transpose_(1, 2).transpose_(2, 3).contiguous()
        y = torch.randn(4, 4)  # one op (normal_)
        y.t_().unsqueeze_(0).squeeze_(0)
    _, names = ops.count_ops(list(prof.events()))
    assert names["transpose_"] == names["t_"] == names["unsqueeze_"] == names["squeeze_"] == 0
    assert names["copy_"] == names["normal_"] == 1 and sum(names.values()) == 2


def test_measure_splits_the_kfac_arm_by_stage() -> None:
    torch.manual_seed(0)
    w = classification("tiny", _tiny, (8, 3, 8, 8), 5)
    r = ops.measure(w, factor_steps=1, inv_steps=2, steps=2, warmup=1)
    sgd, ours = r["arms"]["sgd"], r["arms"]["ours"]
    assert set(r["arms"]) == {"sgd", "ours"} and r["layers"] == 2
    # SGD has no K-FAC stage; K-FAC runs the same model ops plus each stage's.
    assert all(sgd["rows"][row] == 0 for row in ops.ROWS if row != "model + SGD")
    for row in ("factors", "decompositions", "preconditioning", "KL clip"):
        assert ours["rows"][row] > 0, row
    assert ours["extra"] == ours["total"] - sgd["total"] > 0
    assert "extra over SGD" in ops.table(r)


def _kfac_ops_per_step(layers: int, conv: bool) -> dict[str, int]:
    """Compute ops of one K-FAC step (factors and a decomposition) by stage, for a model of ``layers``
    same-shaped layers (3x3 convolutions or Linear layers) and a head of another shape."""
    torch.manual_seed(0)
    if conv:
        body = [m for _ in range(layers) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())]
        model = nn.Sequential(*body, nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
        x = torch.randn(5, 4, 6, 6)
    else:
        body = [m for _ in range(layers) for m in (nn.Linear(8, 8), nn.Tanh())]
        model = nn.Sequential(*body, nn.Linear(8, 3))
        x = torch.randn(5, 8)
    precond = KFACPreconditioner(model, lr=0.1)
    for _ in range(2):  # the first step allocates the running factors
        model.zero_grad()
        with torch.profiler.profile() as prof:
            model(x).square().sum().backward()
            with torch.profiler.record_function("kfac::step()"):
                precond.step()
    rows, _ = ops.count_ops(list(prof.events()))
    return {k: v for k, v in rows.items() if k != "model + SGD"}


@pytest.mark.parametrize(("conv", "kernel"), [(False, None), (True, "unfold"), (True, "pixel")])
def test_kfac_ops_do_not_grow_with_same_shaped_layers(
    conv: bool, kernel: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding calls for their group and with a batched conv kernel, as a GPU does (the CPU computes each
    call on arrival, by the per-call kernels: fastest there), a step's K-FAC ops are a constant per group
    of same-shaped layers."""
    monkeypatch.setitem(batching.HOLD, "cpu", True)
    if kernel is not None:
        monkeypatch.setitem(conv_batched.RULES, "cpu", kernel)
    few, many = _kfac_ops_per_step(2, conv), _kfac_ops_per_step(6, conv)
    assert sum(few.values()) > 0
    assert many == few


def test_counting_with_another_devices_kernel_choices_restores_the_rules() -> None:
    torch.manual_seed(0)
    w = classification("tiny", _tiny, (8, 3, 8, 8), 5)
    r = ops.measure(w, factor_steps=1, inv_steps=2, steps=1, warmup=1, rules="cuda")
    assert r["rules"] == "cuda" and conv_batched.RULES == {"cpu": "per_call"}
    assert batching.HOLD == {"cpu": False}
