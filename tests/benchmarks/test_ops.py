"""The op-count instrument (``benchmarks/ops.py``): what it counts and how it attributes ops to stages."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks import ops
from benchmarks.training_step import classification


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
