"""Reading run directories for ``kfac-bench compare``, including the files a crashed run leaves behind.

A run directory holds ``summary.json`` (written when the run ends), ``eval.jsonl`` (one line per
evaluation, appended as the run goes) and ``config.yaml`` (the composed config, written when the run is
claimed: ``kfac_bench/launcher/rundir.py``). A run killed mid-write leaves a last line cut off in
``eval.jsonl``; a run that never ended has no ``summary.json``, and a copied or half-synced one may have an
empty or truncated one. Such a run is still compared with what is readable: each unreadable file gives one
warning line, and a missing summary is rebuilt from the evaluation records and the recorded config (its
status is ``no summary``; what only the summary knows, such as step times, stays empty). A summary with a
field of the wrong type (edited by hand, or written by another tool) leaves its run out with one warning
naming the file and the field; so does a non-finite number (kfac-bench writes NaN and infinities as
``null``, so a ``NaN`` there was written by something else) and a ``train.seed`` that is true or false. An
evaluation record with such a field counts as an unreadable line. A run without a summary whose
``run.lock`` is still held by a process is *running* (its status), not a run that ended badly.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_bench import safe_files
from kfac_bench.errors import UserError, visible
from kfac_bench.metrics.sinks import EVAL_FILE
from kfac_bench.metrics.summary import SUMMARY_FILE

__all__ = [
    "CONFIG_FILE",
    "LOCK_FILE",
    "NO_SUMMARY",
    "RUNNING",
    "RunRecord",
    "bad_field",
    "is_run",
    "read_run",
    "rebuilt_summary",
    "run_dirs",
    "warn",
]

#: The composed config a run records when it starts (``kfac_bench/launcher/rundir.py`` ``CONFIG_FILE``);
#: Hydra's copy under ``.hydra/`` is the fallback.
CONFIG_FILE = "config.yaml"
#: The status of a run read without a usable ``summary.json``.
NO_SUMMARY = "no summary"
#: The status of a run without a summary that still holds its lock (a process is writing it).
RUNNING = "running"
#: The lock a run holds while it goes (``kfac_bench/launcher/rundir.py`` ``LOCK_FILE``; a test keeps the
#: two equal: compare sits below the launcher and cannot import it).
LOCK_FILE = "run.lock"


@dataclass
class RunRecord:
    """One run directory: its label, summary and evaluation records.

    Attributes:
        label: what the comparison calls it (set by :func:`kfac_bench.compare.arms.label_runs`).
        summary: ``summary.json``, or the summary rebuilt from the records and config when it is unusable.
        evals: the readable records of ``eval.jsonl``, in file order.
        notes: one line per file that could not be read whole.
        campaign: the campaign it is compared under, set only when campaigns are compared as separate
            arms (:mod:`kfac_bench.compare.selection`).
    """

    label: str
    path: Path
    summary: dict[str, Any]
    evals: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    campaign: str | None = None


def warn(line: str) -> None:
    """Print one warning line to stderr (control characters of paths and names escaped)."""
    print(f"kfac-bench: warning: {visible(line)}", file=sys.stderr, flush=True)


def _natural(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def is_run(path: Path) -> bool:
    """Whether ``path`` is a run directory (it holds a summary or evaluation records)."""
    return (path / SUMMARY_FILE).is_file() or (path / EVAL_FILE).is_file()


def run_dirs(
    paths: Sequence[str | Path], on_warning: Callable[[str], None] | None = None
) -> list[Path]:
    """Run directories under ``paths`` in the given order; a folder that is not a run itself (a Hydra
    multirun folder) contributes every run below it, in natural order (job 2 before job 10). A directory
    with ``eval.jsonl`` but no ``summary.json`` (a run that did not end) counts. A directory that recorded
    its config but neither file (a job that stopped before its first evaluation) is named in one line to
    ``on_warning`` and left out; so is a directory given twice.

    Raises:
        UserError: a path does not exist or holds no run.
    """
    on_warning = on_warning or warn
    dirs: list[Path] = []
    seen: set[Path] = set()  # each directory resolved once: a set, not a pairwise comparison
    for given in paths:
        root = Path(given)
        if not root.exists():
            raise UserError(f"run directory '{root}' does not exist")
        if is_run(root):
            found = {root}
        else:
            found = {p.parent for name in (SUMMARY_FILE, EVAL_FILE) for p in root.rglob(name)}
            idle = {p.parent for p in root.rglob(CONFIG_FILE) if p.parent.name != ".hydra"} | {
                p.parent.parent for p in root.rglob(".hydra/config.yaml")
            }
            for path in sorted(idle - found, key=_natural):
                on_warning(
                    f"{path}: left out: no {SUMMARY_FILE} or {EVAL_FILE} (the run stopped before its "
                    "first evaluation, or is still starting)"
                )
            if not found:
                raise UserError(
                    f"no run under '{root}': expected {SUMMARY_FILE} (written when a run ends) or "
                    f"{EVAL_FILE}"
                )
        for path in sorted(found, key=_natural):
            key = _resolved(path)
            if key in seen:
                on_warning(f"{path}: left out: given twice")
                continue
            seen.add(key)
            dirs.append(path)
    return dirs


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:  # a loop of links: the path as given
        return path.absolute()


#: The deepest nesting of a file compare reads (a summary is about 5 levels deep): deeper is not a file
#: kfac-bench wrote, and parsing or walking it could exhaust the stack.
MAX_DEPTH = 64


def _too_deep(data: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``data`` (parsed JSON or YAML) nests deeper than ``limit`` (an iterative walk)."""
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
    return False


def _read_evals(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(the readable records, how many non-empty lines were not) of a JSON-lines file."""
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            bad += 1
            continue
        if _too_deep(record):
            bad += 1
            continue
        clean = _clean_record(record)
        if clean is not None:
            records.append(clean)
        else:
            bad += 1
    return records, bad


_DEEP = f"nested deeper than {MAX_DEPTH} levels"


def _read_json(path: Path) -> dict[str, Any] | str | None:
    """The JSON object in ``path``; None when missing, empty or cut off; a reason (text) when it is
    readable JSON that is no summary (nested too deep for one)."""
    try:
        data = json.loads(path.read_text())
    except RecursionError:
        return _DEEP
    except (OSError, ValueError):
        return None
    if _too_deep(data):
        return _DEEP
    return data if isinstance(data, dict) else None


def _read_config(run_dir: Path) -> dict[str, Any]:
    import yaml

    for path in (run_dir / CONFIG_FILE, run_dir / ".hydra" / "config.yaml"):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError, RecursionError):
            continue
        if isinstance(data, dict) and not _too_deep(data):
            return data
    return {}


#: Non-finite numbers as JSON text writers spell them (``summary.json`` may hold them as strings).
_NON_FINITE = {"NaN": math.nan, "nan": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_NUMBER = "a number"
#: What ``kfac-bench compare`` reads of a summary, and the type each must have (None is always allowed).
_SUMMARY_TYPES: dict[str, str] = {
    "status": "a string",
    "target_metric": "a string",
    "targets": "a mapping",
    "target_value": _NUMBER,
    "higher_is_better": "true or false",
    "reached_target": "true or false",
    "kfac_enabled": "true or false",
    "time_to_target_s": _NUMBER,
    "epochs_to_target": _NUMBER,
    "mean_step_time_s": _NUMBER,
    "kfac_time_fraction": _NUMBER,
    "best_metric": _NUMBER,
    "samples_per_s": _NUMBER,
    "final_metrics": "a mapping",
    "config": "a mapping",
    "wall_time_s": _NUMBER,
    "train_time_s": _NUMBER,
    "epochs": _NUMBER,
    "steps": _NUMBER,
    "kfac_stage_times_s": "a mapping",
    "campaign": "a string",
    "benchmark": "a mapping",
}
#: Fields that are counts or durations: a negative value, or one beyond any run (a billion seconds is
#: 31 years), is not a measurement and leaves the run out.
_NON_NEGATIVE = (
    "time_to_target_s",
    "epochs_to_target",
    "mean_step_time_s",
    "kfac_time_fraction",
    "wall_time_s",
    "train_time_s",
    "epochs",
    "steps",
)
_ABSURD = 1e9
#: Config sections the comparison reads (``config.<section>``), each a mapping when present.
_CONFIG_SECTIONS = (
    "optimizer",
    "kfac",
    "train",
    "task",
    "model",
    "dataset",
    "lr_schedule",
    "tuning",
)
_RECORD_NUMBERS = ("step", "epoch", "wall_time_s")


def _number(value: Any) -> float | None:
    """``value`` as a number (a non-finite one may be spelled as a string, and is refused by
    :func:`_finite`), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return _NON_FINITE.get(value) if isinstance(value, str) else None


def _finite(value: Any) -> bool:
    """None, or a finite number."""
    number = _number(value)
    return value is None or (number is not None and math.isfinite(number))


def _fits(value: Any, kind: str) -> bool:
    if value is None:
        return True
    if kind == _NUMBER:
        return _finite(value)
    if kind == "a string":
        return isinstance(value, str)
    if kind == "a mapping":
        return isinstance(value, dict)
    return isinstance(value, bool)


def bad_field(summary: dict[str, Any]) -> str | None:
    """The first field of ``summary`` that ``compare`` reads and that has the wrong type, as
    ``"field (must be ..., is ...)"``; None when all fit. Non-finite numbers spelled as strings are turned
    into floats in place."""
    for key, kind in _SUMMARY_TYPES.items():
        value = summary.get(key)
        if not _fits(value, kind):
            kind = "a finite number" if kind == _NUMBER else kind
            return f"'{key}' (must be {kind}, is {json.dumps(value)[:40]})"
        if kind == _NUMBER and isinstance(value, str):
            summary[key] = _number(value)
    for key in ("targets", "final_metrics", "kfac_stage_times_s"):
        for name, value in (summary.get(key) or {}).items():
            if not _fits(value, _NUMBER):
                return f"'{key}.{name}' (must be a finite number, is {json.dumps(value)[:40]})"
    for key in _NON_NEGATIVE:
        value = summary.get(key)
        if value is not None and (value < 0 or value > _ABSURD):
            return f"'{key}' (must be between 0 and {_ABSURD:g}, is {json.dumps(value)[:40]})"
    for name, value in (summary.get("kfac_stage_times_s") or {}).items():
        if value is not None and not 0 <= value <= _ABSURD:
            return f"'kfac_stage_times_s.{name}' (must be between 0 and {_ABSURD:g}, is {value})"
    config = summary.get("config") or {}
    for section in _CONFIG_SECTIONS:
        if not _fits(config.get(section), "a mapping"):
            return f"'config.{section}' (must be a mapping, is {json.dumps(config[section])[:40]})"
    return bad_seed(config)


def bad_seed(config: dict[str, Any]) -> str | None:
    """``config.train.seed`` as ``"field (must be ..., is ...)"`` when it is true or false (JSON's ``true``
    would otherwise pair as seed 1); None otherwise. A string or a fraction is not refused: the run is
    compared unpaired (:mod:`kfac_bench.compare.selection` names it)."""
    seed = (config.get("train") or {}).get("seed")
    if isinstance(seed, bool):
        return f"'config.train.seed' (must be an integer, is {json.dumps(seed)})"
    return None


def _clean_record(record: Any) -> dict[str, Any] | None:
    """An evaluation record with its numbers as numbers (non-finite ones may be strings), or None if a
    field compare reads has the wrong type."""
    if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict):
        return None
    numbers = [_number(record.get(k)) for k in _RECORD_NUMBERS]
    if any(v is None or not 0 <= v <= _ABSURD for v in numbers):
        return None
    if not all(_fits(v, _NUMBER) for v in record["metrics"].values()):
        return None  # a non-finite metric too: the writer records one as null
    metrics = {k: v if v is None else _number(v) for k, v in record["metrics"].items()}
    return {**record, "metrics": metrics}


def _met(value: Any, target: float, higher: bool) -> bool:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= target if higher else value <= target


def rebuilt_summary(config: dict[str, Any], evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts of a run's summary that its config and evaluation records determine (as
    :func:`kfac_bench.metrics.summary.run_summary` defines them); the rest is None.

    A run meets its targets at the first record where every target is met; lower-is-better metrics are
    not known without the task, so targets are read as higher-is-better.
    """
    train = config.get("train") or {}
    targets = {str(k): float(v) for k, v in (train.get("targets") or {}).items()}
    metric = (config.get("task") or {}).get("target_metric") or next(iter(targets), None)
    reached = next(
        (
            r
            for r in evals
            if targets and all(_met(r["metrics"].get(k), v, True) for k, v in targets.items())
        ),
        None,
    )
    values = [
        r["metrics"][metric] for r in evals if isinstance(r["metrics"].get(metric), (int, float))
    ]
    last = evals[-1] if evals else {}
    return {
        "name": config.get("name"),
        "status": NO_SUMMARY,
        "target_metric": metric,
        "targets": targets,
        "target_value": targets.get(metric) if metric else None,
        "higher_is_better": True,
        "reached_target": reached is not None,
        "time_to_target_s": reached["wall_time_s"] if reached else None,
        "train_time_to_target_s": reached.get("train_time_s") if reached else None,
        "epochs_to_target": reached["epoch"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "best_metric": max(values) if values else None,
        "final_metrics": last.get("metrics"),
        "epochs": last.get("epoch"),
        "mean_step_time_s": None,
        "samples_per_s": None,
        "kfac_enabled": bool((config.get("kfac") or {}).get("enabled", False)),
        "kfac_time_fraction": None,
        "config": config,
    }


def read_run(run_dir: Path, on_warning: Callable[[str], None] = warn) -> RunRecord | None:
    """The run in ``run_dir``, read with whatever is readable; None (after a warning) if nothing is.

    ``on_warning`` gets one line per file that is cut off, empty or missing.
    """
    run_dir = Path(run_dir)
    evals, bad = _read_evals(run_dir / EVAL_FILE)
    notes = []
    if bad:
        notes.append(
            f"{run_dir / EVAL_FILE}: {bad} unreadable line(s) skipped (cut off by a crash?); "
            f"compared with its {len(evals)} readable record(s)"
        )
    summary = _read_json(run_dir / SUMMARY_FILE)
    if isinstance(summary, str):
        on_warning(
            f"{run_dir / SUMMARY_FILE}: {summary}; left out (not a summary kfac-bench writes)"
        )
        return None
    wrong = bad_field(summary) if summary is not None else None
    if wrong is not None:
        on_warning(
            f"{run_dir / SUMMARY_FILE}: field {wrong}; left out (fix or remove the field, or delete "
            f"the file to compare from {EVAL_FILE})"
        )
        return None
    if summary is None:
        config = _read_config(run_dir)
        if not evals and not config:
            on_warning(f"{run_dir}: no readable {SUMMARY_FILE}, {EVAL_FILE} or config; left out")
            return None
        if not config:
            on_warning(
                f"{run_dir}: no readable {SUMMARY_FILE} or {CONFIG_FILE} (missing, cut off or nested "
                f"deeper than {MAX_DEPTH} levels): its target is unknown; left out"
            )
            return None
        if (seed := bad_seed(config)) is not None:
            on_warning(f"{run_dir / CONFIG_FILE}: field {seed}; left out (fix the field)")
            return None
        running = safe_files.lock_held(run_dir / LOCK_FILE)
        if running:
            notes.append(
                f"{run_dir} is still running (a process holds its {LOCK_FILE}); compared from the "
                f"{len(evals)} evaluation(s) in {EVAL_FILE} so far"
            )
        else:
            state = "missing" if not (run_dir / SUMMARY_FILE).is_file() else "empty or cut off"
            notes.append(
                f"{run_dir / SUMMARY_FILE} is {state} (the run did not end cleanly); compared from "
                f"{EVAL_FILE} and the recorded config"
            )
        summary = rebuilt_summary(config, evals)
        if running:
            summary["status"] = RUNNING
    for note in notes:
        on_warning(note)
    return RunRecord(run_dir.name, run_dir, summary, evals, notes)
