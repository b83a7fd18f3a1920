"""Time-to-target of several runs against the first (the baseline), behind ``kfac-bench compare``.

Reads each run's ``summary.json`` and ``eval.jsonl``; a folder without ``summary.json`` (a Hydra multirun
folder) contributes every run below it, in job order. Writes ``compare.md``, ``compare.csv`` and
``compare.png`` (the target metric against wall-clock time and against epochs, one line per run, the target
drawn) and prints the table.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_bench.errors import UserError
from kfac_bench.metrics.sinks import EVAL_FILE, read_jsonl
from kfac_bench.metrics.summary import SUMMARY_FILE, read_summary

__all__ = ["COLUMNS", "Run", "find_runs", "plot", "render", "table_rows"]

COLUMNS = [
    "run",
    "kfac",
    "status",
    "time_to_target_s",
    "epochs_to_target",
    "time_saved_pct",
    "best_metric",
    "mean_step_time_ms",
    "kfac_overhead_pct",
    "samples_per_s",
]


@dataclass
class Run:
    """One run directory: its label, summary and evaluation records."""

    label: str
    path: Path
    summary: dict[str, Any]
    evals: list[dict[str, Any]]


def _natural(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Runs under ``paths`` in the given order (runs inside one folder in natural order: job 2 before 10).

    Raises:
        UserError: a path does not exist or holds no run.
    """
    runs: list[Run] = []
    for given in paths:
        root = Path(given)
        if not root.exists():
            raise UserError(f"run directory '{root}' does not exist")
        dirs = (
            [root]
            if (root / SUMMARY_FILE).is_file()
            else sorted((p.parent for p in root.rglob(SUMMARY_FILE)), key=_natural)
        )
        if not dirs:
            raise UserError(
                f"no run under '{root}': expected {SUMMARY_FILE} (written when a run ends)"
            )
        runs += [Run(d.name, d, read_summary(d), read_jsonl(d / EVAL_FILE)) for d in dirs]
    _label_by_differences(runs)
    return runs


def _overrides(run_dir: Path) -> list[str] | None:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    import yaml

    return [str(o) for o in yaml.safe_load(path.read_text()) or []]


def _label_by_differences(runs: list[Run]) -> None:
    """Label runs by the command-line overrides that differ between them (``kfac=none``), falling back to
    the folder name, then to the path when names repeat."""
    overrides = [_overrides(r.path) for r in runs]
    if len(runs) > 1 and all(o is not None for o in overrides):
        common = set.intersection(*(set(o) for o in overrides if o is not None))
        for run, own in zip(runs, overrides, strict=True):
            differing = [o for o in own or [] if o not in common and not o.startswith("hydra.")]
            if differing:
                run.label = " ".join(differing)
    labels = [r.label for r in runs]
    if len(set(labels)) < len(labels):
        for r in runs:
            r.label = str(r.path)


def _kfac_label(summary: dict[str, Any]) -> str:
    kfac = summary.get("config", {}).get("kfac", {})
    if not summary.get("kfac_enabled"):
        return "off"
    return str(kfac.get("grad_worker_fraction", "on"))


def table_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per run with the :data:`COLUMNS` (numbers, or None where not applicable)."""
    base = runs[0].summary.get("time_to_target_s")
    rows = []
    for run in runs:
        s = run.summary
        ttt = s.get("time_to_target_s")
        step = s.get("mean_step_time_s")
        overhead = s.get("kfac_time_fraction")
        rows.append(
            {
                "run": run.label,
                "kfac": _kfac_label(s),
                "status": s.get("status"),
                "time_to_target_s": ttt,
                "epochs_to_target": s.get("epochs_to_target"),
                "time_saved_pct": 100.0 * (base - ttt) / base if base and ttt is not None else None,
                "best_metric": s.get("best_metric"),
                "mean_step_time_ms": 1000.0 * step if step is not None else None,
                "kfac_overhead_pct": 100.0 * overhead if overhead is not None else None,
                "samples_per_s": s.get("samples_per_s"),
            }
        )
    return rows


def _cell(key: str, value: Any, reached: bool) -> str:
    if value is None:
        if key in ("time_to_target_s", "epochs_to_target"):
            return "not reached" if not reached else "-"
        return "-"
    if isinstance(value, float):
        return f"{value:+.1f}" if key == "time_saved_pct" else f"{value:.4g}"
    return str(value)


def render(runs: Sequence[Run], fmt: str) -> str:
    """The comparison table as ``terminal`` (aligned columns), ``markdown`` or ``csv`` text."""
    rows = table_rows(runs)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    cells = [
        [_cell(k, r[k], bool(run.summary.get("reached_target"))) for k in COLUMNS]
        for r, run in zip(rows, runs)
    ]
    target = runs[0].summary
    title = f"target: {target.get('target_metric')} {target.get('target_value')} (baseline: {runs[0].label})"
    if fmt == "markdown":
        lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(COLUMNS)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[Run], path: Path) -> Path:
    """PNG: the target metric against wall-clock seconds (left) and epochs (right), target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = runs[0].summary.get("target_metric", "metric")
    target = runs[0].summary.get("target_value")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for run in runs:
        points = [r for r in run.evals if metric in r["metrics"]]
        values = [r["metrics"][metric] for r in points]
        axes[0].plot([r["wall_time_s"] for r in points], values, marker=".", label=run.label)
        axes[1].plot([r["epoch"] for r in points], values, marker=".", label=run.label)
    for ax, xlabel in zip(axes, ("wall-clock time (s)", "epochs")):
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
