"""Time-to-target of arms against a baseline, behind ``kfac-bench compare``.

Reads each run's ``summary.json`` and ``eval.jsonl`` (:mod:`kfac_bench.compare.runs`: a folder that is not
a run, such as a Hydra multirun folder, contributes every run below it; cut-off files give a warning and
the readable part). Runs must share their target (metric and value): time-to-target of different
targets is not comparable, so a mix is refused; finding one arm only gives a warning. Runs are grouped by
arm and setting, several seeds into median and spread (:mod:`kfac_bench.compare.arms`); the baseline is the
first first-order arm unless chosen. Writes ``compare.md`` (the arms side by side and the verdict),
``compare.csv`` (one row per arm: medians, with ``_min``/``_max`` over seeds) and ``compare.png`` (the
target metric against wall-clock time and against epochs, one colour per arm, one line style per seed, the
time to target starred, the target drawn; :mod:`kfac_bench.compare.plot`).
"""

from __future__ import annotations

import csv
import io
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kfac_bench.compare.arms import Group, Spread, choose_baseline, group_runs
from kfac_bench.compare.runs import RunRecord, read_run, run_dirs, warn
from kfac_bench.compare.verdict import TIE, Stats, group_stats, step_ratio, time_ratio, verdict
from kfac_bench.errors import UserError

__all__ = [
    "COLUMNS",
    "CSV_COLUMNS",
    "Comparison",
    "RunRecord",
    "check_same_target",
    "find_runs",
    "output_dir",
    "plot",
    "render",
    "table_rows",
    "write_outputs",
]

#: How the table's time ratio is defined, printed under it (the verdict's clock reads the same ratios).
RATIO_NOTE = (
    "time to target / baseline's: the arm's time over the baseline's, seed by seed where both reached the "
    f"target (< 1: faster); the verdict calls the clock a tie unless every such seed is beyond {TIE:g}x "
    "either way"
)

#: One row per arm (CSV) or one line per measure with the arms side by side (terminal, Markdown).
COLUMNS = [
    "run",
    "kfac",
    "status",
    "seeds",
    "reached",
    "time_to_target_s",
    "epochs_to_target",
    "time_ratio",
    "mean_step_time_ms",
    "step_time_ratio",
    "kfac_overhead_pct",
    "final_metric",
    "min_metric_after_target",
    "best_metric",
    "samples_per_s",
]
#: Columns given as median [min-max] over an arm's runs (the CSV adds ``_min`` and ``_max``).
SPREAD_COLUMNS = (
    "time_to_target_s",
    "epochs_to_target",
    "time_ratio",
    "mean_step_time_ms",
    "step_time_ratio",
    "final_metric",
    "min_metric_after_target",
)
CSV_COLUMNS = [
    c
    for col in COLUMNS
    for c in ([col, f"{col}_min", f"{col}_max"] if col in SPREAD_COLUMNS else [col])
]
#: Row titles of the side-by-side table (``{m}``: the target metric) and digits after the point.
_TITLES = {
    "kfac": ("K-FAC strategy", None),
    "status": ("status", None),
    "seeds": ("seeds", None),
    "reached": ("seeds reaching the target", None),
    "time_to_target_s": ("time to target (s)", 2),
    "epochs_to_target": ("epochs to target", 2),
    "time_ratio": ("time to target / baseline's", 2),
    "mean_step_time_ms": ("mean step time (ms)", 1),
    "step_time_ratio": ("step time / baseline's (K-FAC overhead)", 2),
    "kfac_overhead_pct": ("K-FAC stages, % of training time", 1),
    "final_metric": ("final {m}", 4),
    "min_metric_after_target": ("min {m} after reaching the target", 4),
    "best_metric": ("best {m}", 4),
    "samples_per_s": ("samples/s", 0),
}


def find_runs(
    paths: Sequence[str | Path], on_warning: Callable[[str], None] = warn
) -> list[RunRecord]:
    """The runs under ``paths`` (given order; runs in a folder in natural order), labelled by arm.

    Raises:
        UserError: a path does not exist or holds no readable run.
    """
    runs = [r for d in run_dirs(paths) if (r := read_run(d, on_warning)) is not None]
    if not runs:
        raise UserError("no readable run in " + ", ".join(f"'{p}'" for p in paths))
    check_same_target(runs)
    groups = group_runs(runs)
    if len(groups) == 1:
        on_warning(
            f"only one arm ({groups[0].label}, {len(runs)} run(s)) in "
            + ", ".join(f"'{p}'" for p in paths)
            + ": nothing to compare it with; add the runs of another arm (e.g. a sweep over "
            "+recipe=digits_sgd,digits)"
        )
    return runs


def _target(summary: dict[str, Any]) -> tuple[Any, ...]:
    """What reaching the target means for a run: (metric, targets). The direction follows the metric (and
    a summary rebuilt after a crash does not know it), so it is not compared."""
    metric = summary.get("target_metric")
    targets = summary.get("targets") or {}
    if not targets and summary.get("target_value") is not None:
        targets = {metric: summary["target_value"]}
    return metric, tuple(sorted((str(k), float(v)) for k, v in targets.items()))


def _describe(target: tuple[Any, ...], higher: bool) -> str:
    metric, targets = target
    if not targets:
        return f"{metric} with no target"
    op = ">=" if higher else "<="
    return " and ".join(f"{k} {op} {v:g}" for k, v in targets)


def check_same_target(runs: Sequence[RunRecord]) -> None:
    """Raises UserError when the runs have different targets (metric or value)."""
    kinds: dict[tuple[Any, ...], list[RunRecord]] = {}
    for run in runs:
        kinds.setdefault(_target(run.summary), []).append(run)
    if len(kinds) < 2:
        return
    parts = [
        f"{_describe(k, rs[0].summary.get('higher_is_better', True) is not False)} in '{rs[0].path}'"
        + (f" and {len(rs) - 1} more" if len(rs) > 1 else "")
        for k, rs in kinds.items()
    ]
    raise UserError(
        "runs with different targets are not comparable: "
        + "; ".join(parts)
        + ". Compare the runs of one benchmark and target at a time"
    )


class Comparison:
    """Arms (groups of runs) with the baseline first, their statistics and the verdict lines."""

    def __init__(self, runs: Sequence[RunRecord], baseline: str | None = None) -> None:
        groups = group_runs(runs)
        first = choose_baseline(groups, baseline)
        self.groups: list[Group] = [groups[first], *groups[:first], *groups[first + 1 :]]
        self.stats: list[Stats] = [group_stats(g) for g in self.groups]
        base = self.groups[0].runs[0].summary
        self.metric = str(base.get("target_metric") or "metric")
        self.target = base.get("target_value")
        self.higher = base.get("higher_is_better", True) is not False

    @property
    def baseline(self) -> Group:
        return self.groups[0]

    def verdicts(self) -> list[str]:
        """One line per arm against the baseline (none without a target)."""
        if self.target is None:
            return []
        base = self.stats[0]
        return [
            verdict(s, base, self.metric, float(self.target), self.higher) for s in self.stats[1:]
        ]

    def rows(self) -> list[dict[str, Any]]:
        return [self._row(g, s) for g, s in zip(self.groups, self.stats)]

    def _row(self, group: Group, s: Stats) -> dict[str, Any]:
        ttt = s.spread("time_to_target_s")
        step = s.spread("mean_step_time_s")
        kfac = group.runs[0].summary.get("config", {}).get("kfac") or {}
        statuses = [str(m["status"]) for m in s.measures]
        share = s.spread("kfac_time_fraction").median
        spreads: dict[str, Spread] = {
            "time_to_target_s": ttt,
            "epochs_to_target": s.spread("epochs_to_target"),
            "time_ratio": time_ratio(s, self.stats[0]),
            "mean_step_time_ms": _scaled(step, 1000.0),
            "step_time_ratio": step_ratio(s, self.stats[0]),
            "final_metric": s.spread("final_metric"),
            "min_metric_after_target": s.spread("min_metric_after_target"),
        }
        row: dict[str, Any] = {
            "run": group.label,
            "kfac": "off" if group.first_order else str(kfac.get("grad_worker_fraction", "on")),
            "status": statuses[0]
            if len(set(statuses)) == 1
            else ", ".join(f"{st} {statuses.count(st)}" for st in dict.fromkeys(statuses)),
            "seeds": " ".join("-" if m["seed"] is None else str(m["seed"]) for m in s.measures),
            "reached": f"{s.reached}/{s.n}",
            "kfac_overhead_pct": 100.0 * share if share is not None else None,
            "best_metric": s.spread("best_metric").median,
            "samples_per_s": s.spread("samples_per_s").median,
            "_spreads": spreads,
        }
        for key, sp in spreads.items():
            row[key], row[f"{key}_min"], row[f"{key}_max"] = sp.median, sp.low, sp.high
        return row


def _scaled(sp: Spread, factor: float) -> Spread:
    def scale(v: float | None) -> float | None:
        return None if v is None else v * factor

    return Spread(scale(sp.median), scale(sp.low), scale(sp.high), sp.k, sp.n)


def table_rows(runs: Sequence[RunRecord], baseline: str | None = None) -> list[dict[str, Any]]:
    """One row per arm (baseline first) with :data:`CSV_COLUMNS` (numbers, or None where not
    applicable)."""
    return [{k: r[k] for k in CSV_COLUMNS} for r in Comparison(runs, baseline).rows()]


def _number(value: float | None, digits: int, key: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    # Epochs are whole numbers unless a run evaluates mid-epoch: 19, not 19.0.
    return text.rstrip("0").rstrip(".") if key == "epochs_to_target" and "." in text else text


def _cell(key: str, row: dict[str, Any]) -> str:
    digits = _TITLES[key][1]
    sp: Spread | None = row["_spreads"].get(key)
    if sp is None:
        value = row[key]
        if value is None:
            return "-"
        return (
            f"{value:.{digits}f}" if isinstance(value, float) and digits is not None else str(value)
        )
    assert digits is not None
    to_target = key in ("time_to_target_s", "epochs_to_target")
    if sp.median is None:
        if to_target:
            return "not reached" if sp.k == 0 else f"not reached in {sp.n - sp.k}/{sp.n}"
        return "no seed both reached" if key == "time_ratio" else "-"
    text = _number(sp.median, digits, key)
    if key == "time_ratio":
        low, high = _number(sp.low, digits), _number(sp.high, digits)
        text += f" [{low}-{high}]" if low != high else ""
        return text + (f" ({sp.k}/{sp.n} seeds)" if sp.k < sp.n else "")
    if sp.n > 1 and sp.k > 0:
        high = "miss" if sp.high is None else _number(sp.high, digits, key)
        low = _number(sp.low, digits, key)
        if low != high or sp.k < sp.n:
            text += f" [{low}-{high}]"
    return text


def render(runs: Sequence[RunRecord], fmt: str, baseline: str | None = None) -> str:
    """The comparison as ``terminal`` (aligned text), ``markdown`` (both with the arms side by side and the
    verdict) or ``csv`` (one row per arm) text."""
    return _render(Comparison(runs, baseline), fmt)


def _render(cmp: Comparison, fmt: str) -> str:
    rows = cmp.rows()
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(
            out, fieldnames=CSV_COLUMNS, lineterminator="\n", extrasaction="ignore"
        )
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    title = f"target: {cmp.metric} {cmp.target} (baseline: {cmp.baseline.label})"
    several = any(len(g.runs) > 1 for g in cmp.groups)
    note = "; median [min-max] over seeds" if several else ""
    head = ["arm", *(r["run"] for r in rows)]
    lines = [head]
    for key in COLUMNS[1:]:
        lines.append([_TITLES[key][0].format(m=cmp.metric), *(_cell(key, r) for r in rows)])
    verdicts = cmp.verdicts()
    if fmt == "markdown":
        md = [f"**{title}**{note}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(cells) + " |" for cells in lines[1:]]
        md += ["", f"*{RATIO_NOTE}*", ""] + [f"**Verdict:** {v}" for v in verdicts]
        return "\n".join(md) + "\n"
    widths = [max(len(cells[i]) for cells in lines) for i in range(len(head))]
    text = [title + note]
    text += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
    text += textwrap.wrap(f"({RATIO_NOTE})", 110) + [f"verdict: {v}" for v in verdicts]
    return "\n".join(text) + "\n"


def plot(runs: Sequence[RunRecord], path: Path, baseline: str | None = None) -> Path:
    """PNG: the target metric against wall-clock seconds (left) and epochs (right); see
    :func:`kfac_bench.compare.plot.plot_comparison`."""
    from kfac_bench.compare.plot import plot_comparison

    return plot_comparison(Comparison(runs, baseline), path)


def output_dir(out: Path | str) -> Path:
    """``out``, created if missing.

    Raises:
        UserError: ``out`` is a file, or cannot be created.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--out '{out}' is a file, not a folder: give a folder for the comparison's files"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"--out '{out}' cannot be created ({exc.strerror}): give a writable folder"
        ) from None
    return out


def write_outputs(
    runs: Sequence[RunRecord], out: Path, fmt: str = "terminal", baseline: str | None = None
) -> str:
    """Write ``compare.md``, ``compare.csv`` and ``compare.png`` to ``out``; returns the table in ``fmt``
    followed by a line naming the files.

    Raises:
        UserError: ``baseline`` matches no arm.
    """
    cmp = Comparison(runs, baseline)  # an unknown baseline stops before anything is written
    out = output_dir(out)
    (out / "compare.md").write_text(_render(cmp, "markdown"))
    (out / "compare.csv").write_text(_render(cmp, "csv"))
    from kfac_bench.compare.plot import plot_comparison

    plot_comparison(cmp, out / "compare.png")
    files = ", ".join(str(out / f) for f in ("compare.md", "compare.csv", "compare.png"))
    return _render(cmp, fmt) + f"wrote {files}\n"
