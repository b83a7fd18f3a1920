"""``plan.png``'s memory view: stacked bars, a group per world size and a bar per gradient-worker count,
each part of a rank's memory its own segment (lines of memory against the fraction lay on top of each other
across world sizes)."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from kfac_bench.plan.config import parse_plan_config
from kfac_bench.plan.plot import GIB, PARTS, _memory_bars
from kfac_bench.plan.recipe import load_recipe
from kfac_bench.plan.report import build_plan
from kfac_bench.plan.timing import NOMINAL_V100


def test_memory_bars_keep_every_world_size_and_every_part_apart() -> None:
    plan = build_plan(
        load_recipe(["+recipe=digits"]), parse_plan_config(["world_sizes=[2,4]"]), NOMINAL_V100
    )
    ax = Figure().subplots()
    _memory_bars(ax, plan, [2, 4])
    rows = sorted(
        (
            r
            for r in plan["rows"]
            if r["placement"] == "lpt" and r["factor_reduction"] == "allreduce"
        ),
        key=lambda r: (r["world_size"], r["grad_workers"]),
    )
    bars = ax.patches
    assert len(bars) == len(PARTS) * len(rows) and len(rows) == 2 + 3  # workers 1, 2 | 1, 2, 4
    for i, row in enumerate(rows):
        stack = bars[len(PARTS) * i : len(PARTS) * (i + 1)]
        parts = [row["memory_bytes_per_rank"][key]["max"] / GIB for key, _ in PARTS]
        assert [b.get_height() for b in stack] == pytest.approx(parts)
        assert [b.get_y() for b in stack] == pytest.approx([0, parts[0], parts[0] + parts[1]])
        assert len({round(b.get_x(), 6) for b in stack}) == 1  # one bar, stacked
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(r["grad_workers"]) for r in rows]
    assert [t.get_text() for t in ax.texts] == ["2 GPUs", "4 GPUs"]
