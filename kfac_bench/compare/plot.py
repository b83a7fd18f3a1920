"""``compare.png``: the comparison's target metric against wall-clock time and against epochs (one colour
per arm, one line style per seed, the time to target starred, the target drawn), titled with the runs'
model, data, global batch and devices. Drawn from :class:`kfac_bench.compare.report.Comparison`."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from kfac_bench.compare.runs import RunRecord
from kfac_bench.config import builder_name, model_name
from kfac_bench.errors import visible

if TYPE_CHECKING:
    from kfac_bench.compare.report import Comparison

__all__ = ["comparison_figure", "legend_layout", "plot_comparison"]


#: Line styles telling the seeds of an arm apart (the colour tells the arm).
_SEED_STYLES = ("-", "--", ":", "-.")


def _plain(text: str) -> str:
    """A label from run directories as drawn: control characters escaped, ``$`` taken literally (not the
    start of mathtext, which a stray one would make fail)."""
    return visible(text).replace("$", r"\$")


def _setting_title(cmp: Comparison) -> str:
    """ "small_cnn on digits, global batch 256, 1 x cpu" from the runs' configs (values that differ
    between arms joined with " / ")."""

    def name(run: RunRecord, section: str) -> str:
        cfg = (run.summary.get("config") or {}).get(section) or {}
        return model_name(cfg) if section == "model" else builder_name(cfg)

    def values(get: Callable[[RunRecord], str]) -> str:
        return " / ".join(dict.fromkeys(get(r) for g in cmp.groups for r in g.runs))

    def batch(run: RunRecord) -> str:
        train = (run.summary.get("config") or {}).get("train") or {}
        world = run.summary.get("world_size") or 1
        given = train.get("global_batch_size") or (train.get("batch_size") or 0) * world
        return str(given or "?")

    def where(run: RunRecord) -> str:
        device = run.summary.get("device")
        return f"{run.summary.get('world_size') or 1} x {device}" if device else "?"

    return (
        f"{values(lambda r: name(r, 'model'))} on {values(lambda r: name(r, 'dataset'))}, "
        f"global batch {values(batch)}, {values(where)}"
    )


def _y_range(curves: list[list[float]], target: float | None, higher: bool) -> tuple[float, float]:
    """A y range holding every run's values and the target; for an accuracy-like target (in (0, 1), higher
    is better) it starts ten times the target's distance to 1 below it, to show the approach rather than
    the first epochs' climb, but never above a run's best value (each run stays in view)."""
    values = [v for c in curves for v in c if math.isfinite(v)]
    low, high = min(values, default=0.0), max(values, default=1.0)
    if target is not None:
        low, high = min(low, target), max(high, target)
        if higher and 0 < target < 1:
            bests = [max(c) for c in curves if c]
            low = max(low, min([target - 10 * (1 - target), *bests]))
    pad = 0.06 * (high - low) or 0.01
    return low - pad, high + pad


#: The legend's room: label characters per line, and characters across the figure's width.
_LABEL_WIDTH = 40
_LEGEND_WIDTH = 150


def legend_layout(labels: list[str]) -> tuple[list[str], int]:
    """Labels wrapped at :data:`_LABEL_WIDTH` characters, and as many legend columns as fit the figure's
    width (so a long arm label never runs off it)."""
    labels = [_plain(label) for label in labels]
    wrapped = ["\n".join(textwrap.wrap(label, _LABEL_WIDTH)) or label for label in labels]
    widest = max((len(line) for w in wrapped for line in w.splitlines()), default=1)
    return wrapped, max(1, min(len(labels), 4, _LEGEND_WIDTH // (widest + 8)))


def plot_comparison(cmp: Comparison, path: Path | BinaryIO) -> Path | BinaryIO:
    """Save :func:`comparison_figure` as a PNG at ``path`` or into the open binary file ``path``
    (cropped to what is drawn, legend included)."""
    import matplotlib.pyplot as plt

    fig = comparison_figure(cmp)
    fig.savefig(path, dpi=100, bbox_inches="tight", format="png")
    plt.close(fig)
    return path


def comparison_figure(cmp: Comparison) -> Any:
    """The target metric against wall-clock seconds (left) and epochs (right): one colour per arm, one line
    style per seed, a star where a run first met its target, the target as a dashed line; the title names
    model, data and batch; the legend sits under the plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    metric, target = cmp.metric, cmp.target
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), layout="constrained")
    curves: list[list[float]] = []
    seeds: dict[Any, Any] = {}
    for i, group in enumerate(cmp.groups):
        color = f"C{i % 10}"
        for j, run in enumerate(group.runs):
            seed = group.seeds[j]
            style = seeds.setdefault(seed, _SEED_STYLES[len(seeds) % len(_SEED_STYLES)])
            points = [r for r in run.evals if isinstance(r["metrics"].get(metric), float)]
            values = [r["metrics"][metric] for r in points]
            curves.append(values)
            line = {"color": color, "linestyle": style, "marker": ".", "alpha": 0.85, "lw": 1.3}
            axes[0].plot([r["wall_time_s"] for r in points], values, **line)
            axes[1].plot([r["epoch"] for r in points], values, **line)
            hit = run.summary.get("time_to_target_s")
            at = next((r for r in points if r["wall_time_s"] == hit), None)
            if hit is not None and at is not None:
                star = {"marker": "*", "s": 140, "color": color, "edgecolor": "black", "zorder": 5}
                axes[0].scatter([at["wall_time_s"]], [at["metrics"][metric]], **star)
                axes[1].scatter([at["epoch"]], [at["metrics"][metric]], **star)
    low, high = _y_range(curves, None if target is None else float(target), cmp.higher)
    for ax, xlabel in zip(axes, ("wall-clock time (s)", "epochs")):
        if target is not None:
            ax.axhline(float(target), color="black", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(_plain(metric))
        ax.set_ylim(low, high)
        ax.grid(alpha=0.3)
    handles = [
        Line2D([], [], color=f"C{i % 10}", lw=2, label=g.label) for i, g in enumerate(cmp.groups)
    ]
    if len(seeds) > 1:
        handles += [
            Line2D([], [], color="gray", linestyle=st, label=f"seed {'-' if sd is None else sd}")
            for sd, st in seeds.items()
        ]
    if target is not None:
        handles.append(
            Line2D([], [], color="black", linestyle="--", lw=1, label=f"target {target}")
        )
        handles.append(
            Line2D(
                [],
                [],
                color="gray",
                marker="*",
                markersize=11,
                markeredgecolor="black",
                linestyle="none",
                label="first met the target",
            )
        )
    labels, ncol = legend_layout([str(h.get_label()) for h in handles])
    for handle, label in zip(handles, labels):
        handle.set_label(label)
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=9)
    title = "\n".join(textwrap.wrap(_plain(f"{metric} to target: {_setting_title(cmp)}"), 110))
    fig.suptitle(title, fontsize=11)
    return fig
