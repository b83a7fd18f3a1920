"""Time-to-target of arms against a baseline, behind ``kfac-bench compare``.

Reads each run's ``summary.json`` and ``eval.jsonl`` (:mod:`kfac_bench.compare.runs`: a folder that is not
a run, such as a Hydra multirun folder, contributes every run below it; cut-off files give a warning and
the readable part), keeps one campaign's runs without benchmark-mode runs and repeated seeds
(:mod:`kfac_bench.compare.selection`). Runs must share their target (metric and value): time-to-target of
different targets is not comparable, so a mix is refused; finding one arm only gives a warning. Runs are
grouped by arm and setting, several seeds into median and spread (:mod:`kfac_bench.compare.arms`); the
baseline is the first first-order arm unless chosen. Each arm's time and epochs to target are ratios over
the baseline's with 95 % intervals (:mod:`kfac_bench.compare.stats`, read by
:mod:`kfac_bench.compare.verdict`); fairness flags come from :mod:`kfac_bench.compare.fairness`. Writes
``compare.md`` (the arms side by side and the verdict), ``compare.csv`` (one row per arm: medians, with
``_min``/``_max`` over seeds, and the ratios with ``_ci_low``/``_ci_high``) and ``compare.png`` (the target
metric against wall-clock time and against epochs, one colour per arm, one line style per seed, the time to
target starred, the target drawn; :mod:`kfac_bench.compare.plot`).
"""

from __future__ import annotations

import csv
import io
import os
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from kfac_bench import safe_files
from kfac_bench.compare.arms import Group, Spread, choose_baseline, group_runs
from kfac_bench.compare.fairness import MATCHED, SAME_DESIGN, design_flags, fairness_flags
from kfac_bench.compare.runs import RunRecord, is_run, read_run, run_dirs, warn
from kfac_bench.compare.schedule import blocked_in_time, schedule_of
from kfac_bench.compare.selection import select_runs
from kfac_bench.compare.stats import Interval
from kfac_bench.compare.verdict import (
    Stats,
    claim_of,
    group_stats,
    interval_text,
    ratio_intervals,
    step_ratio,
    verdict,
)
from kfac_bench.errors import UserError, visible

__all__ = [
    "COLUMNS",
    "CSV_COLUMNS",
    "Comparison",
    "RunRecord",
    "check_same_target",
    "csv_safe",
    "default_out",
    "find_runs",
    "output_dir",
    "plot",
    "render",
    "table_rows",
    "write_outputs",
]

#: How the table's ratios and shares are defined, printed under it (the verdict reads the same intervals).
RATIO_NOTE = (
    "time (epochs) to target / baseline's: the geometric mean of the arm's over the baseline's, seed by "
    "seed where both ran the seed, with its 95 % confidence interval [low-high] (method in the 95 % CI row; "
    "a run that missed the target is censored at its training time and leaves the interval open on the "
    "side it could move: inf or 0); the verdict says faster only when the whole interval is below 1, "
    "slower only when it is above 1 (the claim rows, in words a program can read). Seeds for power: how "
    "many seeds per arm the observed spread of time ratios needs to detect a true ratio of 0.9 with 80 % "
    "power (a design figure for the next campaign; none while a run is censored). MLPerf score: the mean "
    "time to target without the fastest and the slowest run. Step time beyond the baseline's and the "
    "K-FAC stages are both % of the arm's mean step time (forward, backward, K-FAC and update; "
    "evaluations outside): where they differ, the rest of the arm's step took more or less time than "
    "the baseline's step"
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
    "epochs_ratio",
    "claim",
    "epochs_claim",
    "schedule",
    "ci_method",
    "seeds_for_power",
    "mlperf_time_s",
    "mean_step_time_ms",
    "step_time_ratio",
    "step_time_extra_pct",
    "kfac_overhead_pct",
    "final_metric",
    "min_metric_after_target",
    "best_metric",
    "samples_per_s",
    "fairness",
]
#: Columns given as median [min-max] over an arm's runs (the CSV adds ``_min`` and ``_max``).
SPREAD_COLUMNS = (
    "time_to_target_s",
    "epochs_to_target",
    "mean_step_time_ms",
    "step_time_ratio",
    "final_metric",
    "min_metric_after_target",
)
#: Ratios given with their 95 % interval (the CSV adds ``_ci_low`` and ``_ci_high``).
INTERVAL_COLUMNS = ("time_ratio", "epochs_ratio")
CSV_COLUMNS = [
    c
    for col in COLUMNS
    for c in (
        [col, f"{col}_min", f"{col}_max"]
        if col in SPREAD_COLUMNS
        else [col, f"{col}_ci_low", f"{col}_ci_high"]
        if col in INTERVAL_COLUMNS
        else [col]
    )
]
#: Row titles of the side-by-side table (``{m}``: the target metric) and digits after the point.
_TITLES = {
    "kfac": ("K-FAC strategy", None),
    "status": ("status", None),
    "seeds": ("seeds", None),
    "reached": ("seeds reaching the target", None),
    "time_to_target_s": ("time to target (s)", 2),
    "epochs_to_target": ("epochs to target", 2),
    "time_ratio": ("time to target / baseline's [95 % CI]", 2),
    "epochs_ratio": ("epochs to target / baseline's [95 % CI]", 2),
    "claim": ("claim on the clock (faster/slower/none)", None),
    "epochs_claim": ("claim in epochs (fewer/more/none)", None),
    "schedule": ("arms in time (interleaved/blocked/unknown)", None),
    "ci_method": ("95 % CI", None),
    "seeds_for_power": ("seeds per arm to detect a time ratio of 0.9, 80 % power", None),
    "mlperf_time_s": ("MLPerf score (5+ seeds; s)", 2),
    "mean_step_time_ms": ("mean step time (ms)", 1),
    "step_time_ratio": ("step time / baseline's", 2),
    "step_time_extra_pct": ("step time beyond the baseline's, % of the arm's step", 1),
    "kfac_overhead_pct": ("K-FAC stages, % of the arm's step", 1),
    "final_metric": ("final {m}", 4),
    "min_metric_after_target": ("min {m} after reaching the target", 4),
    "best_metric": ("best {m}", 4),
    "samples_per_s": ("samples/s", 0),
    "fairness": ("fairness", None),
}


def find_runs(
    paths: Sequence[str | Path],
    on_warning: Callable[[str], None] = warn,
    by_campaign: bool = False,
) -> list[RunRecord]:
    """The runs under ``paths`` (given order; runs in a folder in natural order), labelled by arm: one
    campaign (or each campaign its own arms with ``by_campaign``), without benchmark-mode runs and
    repeated seeds (:mod:`kfac_bench.compare.selection`); every run directory left out is named in one
    line to ``on_warning``.

    Raises:
        UserError: a path does not exist or holds no readable run, or the runs are of several campaigns
            or targets.
    """
    found = [r for d in run_dirs(paths, on_warning) if (r := read_run(d, on_warning)) is not None]
    if not found:
        raise UserError("no readable run in " + ", ".join(f"'{p}'" for p in paths))
    runs = select_runs(found, by_campaign, on_warning)
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
        base_runs = [r.summary for r in self.groups[0].runs]
        self.flags: list[list[str]] = [
            fairness_flags(base_runs, "baseline"),
            *(
                fairness_flags([r.summary for r in g.runs], g.label)
                + design_flags([r.summary for r in g.runs], base_runs, g.label)
                for g in self.groups[1:]
            ),
        ]
        self.intervals: list[dict[str, Interval] | None] = [None] + [
            ratio_intervals(s, self.stats[0]) for s in self.stats[1:]
        ]
        #: Per arm: why its clock claim cannot be told apart from load drift (None: it can), and how its
        #: runs sat in time beside the baseline's (:mod:`kfac_bench.compare.schedule`).
        self.blocked: list[str | None] = [None]
        self.blocked += [
            blocked_in_time([r.summary for r in g.runs], base_runs, g.label, self.groups[0].label)
            for g in self.groups[1:]
        ]
        self.schedules: list[str] = ["baseline"] + [
            "blocked" if b else schedule_of([r.summary for r in g.runs], base_runs)
            for g, b in zip(self.groups[1:], self.blocked[1:])
        ]

    @property
    def baseline(self) -> Group:
        return self.groups[0]

    def verdicts(self) -> list[str]:
        """One line per arm against the baseline (none without a target), ending with the fairness flags
        of the arm and the baseline."""
        if self.target is None:
            return []
        base = self.stats[0]
        return [
            verdict(
                s,
                base,
                self.metric,
                float(self.target),
                self.higher,
                [*self.flags[0], *flags],
                blocked=blocked,
            )
            for s, flags, blocked in zip(self.stats[1:], self.flags[1:], self.blocked[1:])
        ]

    def rows(self) -> list[dict[str, Any]]:
        return [self._row(i, g, s) for i, (g, s) in enumerate(zip(self.groups, self.stats))]

    def _row(self, i: int, group: Group, s: Stats) -> dict[str, Any]:
        ttt = s.spread("time_to_target_s")
        step = s.spread("mean_step_time_s")
        kfac = group.runs[0].summary.get("config", {}).get("kfac") or {}
        statuses = [str(m["status"]) for m in s.measures]
        share = s.spread("kfac_step_share").median
        ratio = step_ratio(s, self.stats[0]).median
        intervals = self.intervals[i]
        spreads: dict[str, Spread] = {
            "time_to_target_s": ttt,
            "epochs_to_target": s.spread("epochs_to_target"),
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
            "step_time_extra_pct": 100.0 * (1 - 1 / ratio) if ratio else None,
            "best_metric": s.spread("best_metric").median,
            "samples_per_s": s.spread("samples_per_s").median,
            "mlperf_time_s": s.mlperf(),
            "schedule": self.schedules[i],
            "fairness": "; ".join(self.flags[i])
            or (MATCHED if i == 0 else f"{MATCHED}; {SAME_DESIGN}"),
            "_spreads": spreads,
            "_intervals": intervals,
        }
        for key, sp in spreads.items():
            row[key], row[f"{key}_min"], row[f"{key}_max"] = sp.median, sp.low, sp.high
        if intervals is None:  # the baseline
            row.update(time_ratio=1.0, epochs_ratio=1.0, ci_method="baseline")
            row.update(
                claim=claim_of(None), epochs_claim=claim_of(None, "epochs"), seeds_for_power=None
            )
            for key in INTERVAL_COLUMNS:
                row[f"{key}_ci_low"] = row[f"{key}_ci_high"] = None
        else:
            for key, name in (("time_ratio", "time"), ("epochs_ratio", "epochs")):
                iv = intervals[name]
                row[key], row[f"{key}_ci_low"], row[f"{key}_ci_high"] = iv.ratio, iv.low, iv.high
            methods = dict.fromkeys(iv.method for iv in intervals.values())
            row["ci_method"] = "; ".join(methods)
            # Arms run in separate blocks of time: the clock cannot separate them from load drift.
            row["claim"] = claim_of(None if self.blocked[i] else intervals["time"])
            row["epochs_claim"] = claim_of(intervals["epochs"], "epochs")
            row["seeds_for_power"] = intervals["time"].seeds_for_power
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
    if key in INTERVAL_COLUMNS:
        intervals = row["_intervals"]
        if intervals is None:
            return "1 (baseline)"
        return interval_text(intervals["time" if key == "time_ratio" else "epochs"])
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
        return "-"
    text = _number(sp.median, digits, key)
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
        writer.writerows({k: csv_safe(v) for k, v in row.items()} for row in rows)
        return out.getvalue()
    title = f"target: {cmp.metric} {cmp.target} (baseline: {cmp.baseline.label})"
    several = any(len(g.runs) > 1 for g in cmp.groups)
    note = "; median [min-max] over seeds" if several else ""
    head = ["arm", *(r["run"] for r in rows)]
    lines = [head]
    for key in COLUMNS[1:]:
        lines.append([_TITLES[key][0].format(m=cmp.metric), *(_cell(key, r) for r in rows)])
    verdicts = [visible(v) for v in cmp.verdicts()]
    title = visible(title)
    # Labels come from run directories (campaign names, paths): never raw control characters or a `|`
    # that would end a markdown cell.
    lines = [[visible(c) for c in cells] for cells in lines]
    head = lines[0]
    if fmt == "markdown":
        table = [[c.replace("|", "\\|") for c in cells] for cells in lines]
        md = [
            f"**{title}**{note}",
            "",
            "| " + " | ".join(table[0]) + " |",
            "|" + "---|" * len(head),
        ]
        md += ["| " + " | ".join(cells) + " |" for cells in table[1:]]
        md += ["", f"*{RATIO_NOTE}*", ""] + [f"**Verdict:** {v}" for v in verdicts]
        return "\n".join(md) + "\n"
    widths = [max(len(cells[i]) for cells in lines) for i in range(len(head))]
    text = [title + note]
    text += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
    text += textwrap.wrap(f"({RATIO_NOTE})", 110) + [f"verdict: {v}" for v in verdicts]
    return "\n".join(text) + "\n"


#: First characters that make a spreadsheet read a cell as a formula (CSV injection).
_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(value: Any) -> Any:
    """A text cell that a spreadsheet would read as a formula, quoted with a leading ``'``; numbers and
    other text as they are."""
    if isinstance(value, str) and value.startswith(_FORMULA):
        return "'" + value
    return value


def plot(
    runs: Sequence[RunRecord], path: Path | BinaryIO, baseline: str | None = None
) -> Path | BinaryIO:
    """PNG: the target metric against wall-clock seconds (left) and epochs (right); see
    :func:`kfac_bench.compare.plot.plot_comparison`."""
    from kfac_bench.compare.plot import plot_comparison

    return plot_comparison(Comparison(runs, baseline), path)


def default_out(paths: Sequence[str | Path], kind: str = "compare") -> Path:
    """Where a comparison of ``paths`` goes when ``--out`` is not given: a new ``KIND_<time>_<uid>``
    folder inside the compared folder (the folder given, or the folder holding the run directories
    given; their common folder when several), so a second comparison never overwrites the first. When
    that folder is the current directory or above it, ``runs/`` (which git ignores) takes its place."""
    folders = [Path(p).resolve() for p in paths]
    folders = [f.parent if is_run(f) else f for f in folders]
    try:
        common = Path(os.path.commonpath([str(f) for f in folders]))
    except ValueError:  # different drives
        common = Path.cwd()
    cwd = Path.cwd().resolve()
    if common == cwd or common in cwd.parents:
        common = Path("runs")
    return common / safe_files.new_folder_name(kind)


def output_dir(out: Path | str) -> safe_files.Folder:
    """The open output folder ``out``, made if missing (the one rule of every command's output folder:
    missing or empty, :func:`kfac_bench.safe_files.output_folder`); close it (or use ``with``).

    Raises:
        UserError: ``out`` is a file, holds anything, or cannot be created.
    """
    return safe_files.output_folder(out, f"--out '{out}'", "the comparison's files")


def write_outputs(
    runs: Sequence[RunRecord],
    out: Path | safe_files.Folder,
    fmt: str = "terminal",
    baseline: str | None = None,
) -> str:
    """Write ``compare.md``, ``compare.csv`` and ``compare.png`` to ``out`` (a path: a new or empty folder,
    :func:`output_dir`; an open folder: the caller's, e.g. the demo's, already holding its runs), each
    replaced atomically and never through a link; returns the table in ``fmt`` followed by a line naming
    the files.

    Raises:
        UserError: ``baseline`` matches no arm; ``out`` (a path) is not a new or empty folder.
    """
    from kfac_bench.compare.plot import plot_comparison

    cmp = Comparison(runs, baseline)  # an unknown baseline stops before anything is written
    folder = out if isinstance(out, safe_files.Folder) else output_dir(out)
    try:
        written = [
            folder.write("compare.md", _render(cmp, "markdown")),
            folder.write("compare.csv", _render(cmp, "csv")),
            folder.replace("compare.png", lambda f: plot_comparison(cmp, f)),
        ]
    finally:
        if folder is not out:
            folder.close()
    return _render(cmp, fmt) + f"wrote {', '.join(str(p) for p in written)}\n"
