"""BERT chains, behind ``kfac-bench compare --chain NAME=PHASE1_RUN,PHASE2_RUN,SQUAD_RUN``: each chain's final
SQuAD v1.1 F1 and its time to solution, the first chain being the baseline.

A chain is the pretraining runs in order (phase 1, phase 2; any number of at least one) followed by the
SQuAD fine-tuning run that scores them. As TPDS §6.3.3 counts it, the **time to solution is the sum of the
pretraining phases' training time** and the result is the fine-tuned model's F1 on dev-v1.1 (target 90.1 %,
the LAMB baseline). Training time is each run's ``train_time_s``: the optimizer steps, without the held-out
evaluations (kfac-bench's addition; the reference pretraining evaluates nothing) and checkpoint writes.
Fine-tuning is not counted: it is the same fixed procedure for every arm (2 epochs of the same recipe,
K-FAC off), it measures the pretrained model rather than training it, and the paper's overall times
(Table 4's -6.2 / -9.0 / -4.7 %) are pretraining times; its time is shown in its own column.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_bench import safe_files
from kfac_bench.errors import UserError, visible
from kfac_bench.metrics.summary import SUMMARY_FILE, read_summary

__all__ = [
    "CHAIN_COLUMNS",
    "Chain",
    "chain_rows",
    "compare_chains",
    "load_chain",
    "parse_chain",
    "render_chains",
]

CHAIN_COLUMNS = [
    "chain",
    "pretraining",
    "f1",
    "exact_match",
    "reached",
    "time_to_solution_s",
    "time_ratio",
    "phase_times_s",
    "finetune_time_s",
    "status",
]
_USAGE = "--chain NAME=PHASE1_RUN,PHASE2_RUN,SQUAD_RUN"
_PRETRAIN_TASK = "kfac_bench.tasks.masked_lm.build_masked_lm"
_FINETUNE_TASK = "kfac_bench.tasks.squad.build_squad_task"


@dataclass
class Chain:
    """One chain: its name, run directories and their ``summary.json``; ``notes`` lists broken links."""

    name: str
    paths: list[Path]
    summaries: list[dict[str, Any]]
    notes: list[str]

    @property
    def pretraining(self) -> list[dict[str, Any]]:
        return self.summaries[:-1]

    @property
    def finetune(self) -> dict[str, Any]:
        return self.summaries[-1]


def parse_chain(spec: str) -> tuple[str, list[Path]]:
    """``NAME=RUN,RUN,...`` -> (NAME, run directories).

    Raises:
        UserError: no ``=``, an empty name or run, or fewer than two runs.
    """
    name, sep, runs = spec.partition("=")
    paths = [p.strip() for p in runs.split(",")]
    if not sep or not name.strip() or not all(paths) or len(paths) < 2:
        raise UserError(
            f"compare: bad chain '{spec}': expected {_USAGE} (pretraining runs in order, then the "
            "SQuAD fine-tuning run)"
        )
    return name.strip(), [Path(p) for p in paths]


def _task(summary: dict[str, Any]) -> str:
    return str(summary.get("config", {}).get("task", {}).get("_target_", "?"))


def _started_from(child: dict[str, Any], parent: Path) -> bool:
    """Whether ``child``'s ``model.init_checkpoint`` is a checkpoint of the run directory ``parent``."""
    init = child.get("config", {}).get("model", {}).get("init_checkpoint")
    if not init:
        return False
    run_dir = Path(init).parent.parent  # RUN_DIR/checkpoints/last.pt
    if run_dir.is_dir() and parent.is_dir():
        return os.path.samefile(run_dir, parent)
    return run_dir.name == parent.name  # moved since: the run directory's name still tells


def load_chain(name: str, paths: Sequence[Path]) -> Chain:
    """Read a chain's summaries and check its shape.

    Raises:
        UserError: a run directory without ``summary.json``, a pretraining position holding a run of
            another task, or a last run that is not SQuAD fine-tuning.
    """
    summaries = []
    for i, path in enumerate(paths):
        if not (path / SUMMARY_FILE).is_file():
            raise UserError(
                f"compare: chain '{name}': no {SUMMARY_FILE} in '{path}' (a run directory writes it when "
                "the run ends)"
            )
        summary = read_summary(path)
        last = i == len(paths) - 1
        expected = _FINETUNE_TASK if last else _PRETRAIN_TASK
        if _task(summary) != expected:
            role = "SQuAD fine-tuning run (the last of a chain)" if last else "BERT pretraining run"
            raise UserError(
                f"compare: chain '{name}': '{path}' is not a {role}: its task is {_task(summary)}; "
                f"expected {_USAGE}"
            )
        summaries.append(summary)
    notes = [
        f"chain '{name}': '{child}' did not start from a checkpoint of '{parent}'"
        for parent, child, summary in zip(paths, paths[1:], summaries[1:])
        if not _started_from(summary, parent)
    ]
    return Chain(name, list(paths), summaries, notes)


def _arm(summary: dict[str, Any]) -> str:
    optimizer = str(summary.get("config", {}).get("optimizer", {}).get("name", "?"))
    method = "K-FAC" if summary.get("kfac_enabled") else optimizer.upper()
    return f"{method} {summary.get('steps')}"


def _status(chain: Chain) -> str:
    bad = [
        f"{p.name}: {s.get('status')}"
        for p, s in zip(chain.paths, chain.summaries)
        if s.get("status") not in ("success", "target_not_reached")
    ]
    return "; ".join(bad) or "finished"


def chain_rows(chains: Sequence[Chain]) -> list[dict[str, Any]]:
    """One row per chain with the :data:`CHAIN_COLUMNS` (numbers, or None where unknown)."""
    rows = []
    for chain in chains:
        times = [s.get("train_time_s") for s in chain.pretraining]
        known = [float(t) for t in times if t is not None]
        total = sum(known) if len(known) == len(times) else None
        final = chain.finetune.get("final_metrics") or {}
        f1, target = final.get("f1"), chain.finetune.get("targets", {}).get("f1")
        rows.append(
            {
                "chain": chain.name,
                "pretraining": " + ".join(_arm(s) for s in chain.pretraining),
                "f1": f1,
                "exact_match": final.get("exact_match"),
                "reached": None if f1 is None or target is None else f1 >= target,
                "time_to_solution_s": total,
                "phase_times_s": " + ".join(f"{t:.1f}" for t in known),
                "finetune_time_s": chain.finetune.get("train_time_s"),
                "status": _status(chain),
            }
        )
    base = rows[0]["time_to_solution_s"] if rows else None
    for row in rows:
        # As compare's table: the chain's time over the baseline's (< 1: faster).
        row["time_ratio"] = _ratio(row["time_to_solution_s"], base)
    return rows


def _ratio(total: Any, base: Any) -> float | None:
    if isinstance(total, (int, float)) and isinstance(base, (int, float)) and base:
        return float(total) / float(base)
    return None


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}" if key in ("f1", "exact_match", "time_ratio") else f"{value:.1f}"
    return str(value)


def render_chains(chains: Sequence[Chain], fmt: str) -> str:
    """The chain table as ``terminal`` (aligned columns), ``markdown`` or ``csv`` text, after a title line
    naming the target and the baseline (and a line per broken link)."""
    rows = chain_rows(chains)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=CHAIN_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    target = chains[0].finetune.get("targets", {}).get("f1")
    title = (
        f"target: SQuAD v1.1 f1 >= {target} (baseline: {chains[0].name}); time to solution = sum of the "
        "pretraining phases' training time (TPDS §6.3.3; fine-tuning not counted); time_ratio = a chain's "
        "time to solution / the baseline's (< 1: faster)"
    )
    # Names and labels come from the command line and run directories: control characters escaped
    # (and a `|` in a markdown cell), so they neither drive the terminal nor break the table.
    title = visible(title)
    notes = [visible(f"note: {n}") for c in chains for n in c.notes]
    cells = [[visible(_cell(k, r[k])) for k in CHAIN_COLUMNS] for r in rows]
    if fmt == "markdown":
        lines = [f"**{title}**", ""]
        lines += ["| " + " | ".join(CHAIN_COLUMNS) + " |", "|" + "---|" * len(CHAIN_COLUMNS)]
        lines += ["| " + " | ".join(x.replace("|", "\\|") for x in c) + " |" for c in cells]
        return "\n".join([*lines, *(["", *notes] if notes else [])]) + "\n"
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(CHAIN_COLUMNS)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(CHAIN_COLUMNS, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([*lines, *notes]) + "\n"


def compare_chains(specs: Sequence[str], out: Path | safe_files.Folder) -> list[Chain]:
    """Load the chains of ``--chain`` arguments and write ``chains.md`` and ``chains.csv`` to ``out`` (a
    path: a new or empty folder, made once the chains are read; or an open folder), each replaced
    atomically and never through a link.

    Raises:
        UserError: a bad specification, a repeated chain name, a chain of the wrong shape, or ``out`` (a
            path) not a new or empty folder.
    """
    parsed = [parse_chain(spec) for spec in specs]
    names = [name for name, _ in parsed]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise UserError(f"compare: chain name '{repeated}' is given twice: name each chain once")
    chains = [load_chain(name, paths) for name, paths in parsed]
    folder = (
        out
        if isinstance(out, safe_files.Folder)
        else safe_files.output_folder(out, f"--out '{out}'", "the chains' files")
    )
    try:
        folder.write("chains.md", render_chains(chains, "markdown"))
        folder.write("chains.csv", render_chains(chains, "csv"))
    finally:
        if folder is not out:
            folder.close()
    return chains
