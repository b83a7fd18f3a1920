"""``plan.png``: per-rank memory against the gradient-worker fraction, and the decomposition makespan (the
fullest rank's Σ n³) against the world size, next to the ideal total/N and the floor of the largest factor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_plan"]

GIB = 2**30


def plot_plan(plan: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan["rows"]
    worlds = sorted({r["world_size"] for r in rows})
    fig, (mem_ax, cost_ax) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(worlds):
        for reduction, style in (("allreduce", "-"), ("reduce", "--")):
            pts = sorted(
                (r["grad_worker_fraction"], r["memory_bytes_per_rank"]["total"]["max"] / GIB)
                for r in rows
                if r["world_size"] == n
                and r["placement"] == "lpt"
                and r["factor_reduction"] == reduction
            )
            if pts:
                label = f"{n} GPUs" if reduction == "allreduce" else None
                color = colors[i % len(colors)]
                mem_ax.plot(*zip(*pts), style, color=color, marker=".", label=label)
    mem_ax.plot([], [], "--", color="gray", label="factors reduced to their owner")
    if "memory_budget_gb" in plan:
        mem_ax.axhline(plan["memory_budget_gb"], color="black", linewidth=1, label="budget")
    mem_ax.set_xscale("log", base=2)
    mem_ax.set_xlabel("grad_worker_fraction (1/N = MEM-OPT ... 1 = COMM-OPT)")
    mem_ax.set_ylabel("K-FAC memory on the fullest rank (GiB, peak)")
    mem_ax.set_title(f"{plan['recipe']}: memory per GPU (LPT placement)")
    mem_ax.legend(fontsize=7)

    def series(placement: str) -> list[tuple[int, float]]:
        out = []
        for n in worlds:
            costs = [
                r["decomposition_cost_per_rank"]["max"]
                for r in rows
                if r["world_size"] == n
                and r["placement"] == placement
                and r["grad_workers"] == n
                and r["factor_reduction"] == "allreduce"
            ]
            if costs:
                out.append((n, costs[0]))
        return out

    for placement, label in (("lpt", "LPT (KAISA)"), ("round_robin", "round robin (SC20)")):
        pts = series(placement)
        if pts:
            cost_ax.plot(*zip(*pts), marker="o", label=f"{label}, COMM-OPT")
    firsts = {r["world_size"]: r["decomposition_cost_per_rank"] for r in rows}
    cost_ax.plot(
        worlds, [firsts[n]["ideal"] for n in worlds], ":", color="gray", label="ideal Σn³ / N"
    )
    cost_ax.axhline(
        firsts[worlds[0]]["floor"], color="black", linewidth=1, label="largest factor n³"
    )
    cost_ax.set_xscale("log", base=2)
    cost_ax.set_yscale("log")
    cost_ax.set_xlabel("GPUs")
    cost_ax.set_ylabel("Σ n³ on the busiest rank")
    cost_ax.set_title("decomposition makespan")
    cost_ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
