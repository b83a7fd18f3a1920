"""``plan.png``: per-rank memory as stacked bars (its parts, a group per world size and a bar per
gradient-worker count), and the decomposition makespan (the fullest rank's Σ n³) against the world size,
next to the ideal total/N and the floor of the largest factor."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["plot_plan", "plot_time_to_solution"]

GIB = 2**30


def _title(plan: dict[str, Any]) -> str:
    """The recipe and the model actually planned (``model.arch=resnet152`` under resnet50_imagenet)."""
    model = plan.get("model")
    return f"{plan['recipe']} ({model})" if model else str(plan["recipe"])


#: The parts of a rank's K-FAC memory (``memory_usage()["total"]`` is their sum), bottom to top.
PARTS = (
    ("factors", "factors"),
    ("decompositions", "decompositions"),
    ("buffers", "buffers (peak)"),
)


def _memory_bars(ax: Any, plan: dict[str, Any], worlds: list[int]) -> None:
    """Stacked bars, a group per world size and a bar per gradient-worker count (LPT placement, factors
    all-reduced): each part's fullest rank, a black tick at the fullest rank's total, a triangle at the
    total with factors reduced to their owner instead. Lines of memory against the fraction sat on top of
    each other (COMM-OPT holds the same per rank at every N); bars keep every world size apart."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lpt = [r for r in plan["rows"] if r["placement"] == "lpt"]
    x, ticks, labels, centers = 0.0, [], [], []
    for n in worlds:
        start = x
        for workers in sorted({r["grad_workers"] for r in lpt if r["world_size"] == n}):
            at = {
                r["factor_reduction"]: r
                for r in lpt
                if r["world_size"] == n and r["grad_workers"] == workers
            }
            row = at.get("allreduce")
            if row is not None:
                mem = row["memory_bytes_per_rank"]
                bottom = 0.0
                for i, (key, _) in enumerate(PARTS):
                    height = mem[key]["max"] / GIB
                    ax.bar(x, height, 0.8, bottom=bottom, color=f"C{i}", edgecolor="white", lw=0.4)
                    bottom += height
                ax.plot([x - 0.4, x + 0.4], [mem["total"]["max"] / GIB] * 2, color="black", lw=1.5)
            if "reduce" in at:
                total = at["reduce"]["memory_bytes_per_rank"]["total"]["max"] / GIB
                ax.plot([x], [total], "v", color="black", markersize=5)
            ticks.append(x)
            labels.append(str(workers))
            x += 1
        centers.append(((start + x - 1) / 2, n))
        x += 1  # a gap between world sizes
    ax.set_xticks(ticks, labels, fontsize=7)
    for center, n in centers:
        ax.annotate(
            f"{n} GPUs",
            (center, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -22),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=9,
        )
    handles: list[Any] = [Patch(color=f"C{i}", label=label) for i, (_, label) in enumerate(PARTS)]
    handles += [
        Line2D([], [], color="black", lw=1.5, label="total, fullest rank"),
        Line2D(
            [], [], color="black", marker="v", ls="none", label="total, factors reduced to owner"
        ),
    ]
    if "memory_budget_gb" in plan:
        ax.axhline(plan["memory_budget_gb"], color="red", linewidth=1)
        handles.append(Line2D([], [], color="red", lw=1, label="budget"))
    ax.set_xlabel(
        "gradient workers per layer (1 = MEM-OPT ... N = COMM-OPT), grouped by GPUs", labelpad=24
    )
    ax.set_ylabel("K-FAC memory per GPU (GiB, each part's fullest rank; not the model's)")
    ax.set_title(f"{_title(plan)}: K-FAC memory per GPU (LPT placement)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
    ax.legend(handles=handles, fontsize=7, loc="upper left", ncol=3)


def plot_plan(plan: dict[str, Any], path: Path | BinaryIO) -> Path | BinaryIO:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan["rows"]
    worlds = sorted({r["world_size"] for r in rows})
    fig, (mem_ax, cost_ax) = plt.subplots(
        1, 2, figsize=(14, 5), layout="constrained", gridspec_kw={"width_ratios": [1.6, 1]}
    )
    _memory_bars(mem_ax, plan, worlds)

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
    if isinstance(path, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def _time_bars(ax: Any, plan: dict[str, Any]) -> None:
    """Minutes to the end of training as bars, a group per world size and a bar per arm (TPDS Fig. 8's
    layout), each labelled with its minutes, its band drawn as an error bar; log scale."""
    entries = [e for e in plan["time_to_solution"] if e["minutes"] is not None]
    arms = list(dict.fromkeys(e["arm"] for e in plan["time_to_solution"]))
    worlds = sorted({e["world_size"] for e in plan["time_to_solution"]})
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        at = {e["world_size"]: e["minutes"] for e in entries if e["arm"] == arm}
        xs = [j + (i - (len(arms) - 1) / 2) * width for j, n in enumerate(worlds) if n in at]
        ys = [at[n] for n in worlds if n in at]
        band = {
            e["world_size"]: (e["minutes"] - e["minutes_low"], e["minutes_high"] - e["minutes"])
            for e in entries
            if e["arm"] == arm and e.get("minutes_low") is not None
        }
        err = [[band.get(n, (0, 0))[j] for n in worlds if n in at] for j in (0, 1)]
        bars = ax.bar(xs, ys, width, label=arm, color=f"C{i}", yerr=err, capsize=2, ecolor="black")
        ax.bar_label(bars, [f"{y:.0f}" for y in ys], fontsize=6, padding=1)
    ax.set_xticks(range(len(worlds)), [str(n) for n in worlds])
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("minutes to the end of training")
    source = plan.get("time_to_solution_model", {}).get("profile", {}).get("path", "")
    ax.set_title(
        f"{_title(plan)}: projected time to solution, band as error bars ({source})", fontsize=9
    )
    ax.legend(fontsize=8)


def plot_time_to_solution(plan: dict[str, Any], path: Path | BinaryIO) -> Path | BinaryIO:
    """``time_to_solution.png``: :func:`_time_bars`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = {e["world_size"] for e in plan["time_to_solution"]}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(worlds) + 2), 4.5), layout="constrained")
    _time_bars(ax, plan)
    if isinstance(path, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path
