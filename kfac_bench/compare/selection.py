"""Which runs one comparison holds: one campaign, no benchmark-mode runs, one run per arm and seed.

A **campaign** is the set of runs started to be compared together: ``train.campaign`` when set, else the
Hydra sweep folder of a ``--multirun`` job, else none (recorded in ``summary.json`` as ``campaign``,
:func:`kfac_bench.metrics.summary.run_summary`). Pooling two campaigns would mix runs made under other
conditions (another day's load, another code version) into one arm and pair their seeds, so a comparison
of runs from several campaigns is refused in one line, unless they are compared as separate arms
(``--by-campaign``: each arm is labelled ``ARM @ CAMPAIGN``).

A ``train.mode=benchmark`` run measures throughput and never runs to a target: it is left out, named.
Two runs of one arm with the same seed are not two samples: the first (in the order given) is kept and
the others are named and left out, so a seed is never paired twice. A run whose ``train.seed`` is not an
integer (a string, a fraction; true and false are refused when it is read) pairs with nothing: it is named
and compared unpaired.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kfac_bench.compare.arms import group_runs
from kfac_bench.compare.runs import RunRecord
from kfac_bench.errors import UserError

__all__ = ["NO_CAMPAIGN", "campaign_name", "campaign_of", "is_benchmark", "select_runs"]

#: How a run without a campaign is named.
NO_CAMPAIGN = "no campaign"


def campaign_of(summary: dict[str, Any]) -> str | None:
    """The run's campaign: the summary's ``campaign``, else its config's ``train.campaign``."""
    campaign = summary.get("campaign")
    if campaign is None:
        campaign = ((summary.get("config") or {}).get("train") or {}).get("campaign")
    return None if campaign is None else str(campaign)


def campaign_name(campaign: str | None) -> str:
    """A campaign as printed: a sweep folder by its own name, ``no campaign`` for none."""
    if campaign is None:
        return NO_CAMPAIGN
    return Path(campaign).name or campaign


def is_benchmark(summary: dict[str, Any]) -> bool:
    """Whether the run is a ``train.mode=benchmark`` run (a throughput measurement)."""
    mode = ((summary.get("config") or {}).get("train") or {}).get("mode")
    return summary.get("benchmark") is not None or str(mode) == "benchmark"


def _refuse_mixed(runs: Sequence[RunRecord], campaigns: list[str | None]) -> None:
    kinds: dict[str | None, list[RunRecord]] = {}
    for run, campaign in zip(runs, campaigns):
        kinds.setdefault(campaign, []).append(run)
    if len(kinds) < 2:
        return
    parts = [
        f"'{campaign_name(c)}' ({len(rs)} run(s), e.g. '{rs[0].path}')" for c, rs in kinds.items()
    ]
    raise UserError(
        f"runs of {len(kinds)} campaigns in one comparison: "
        + ", ".join(parts)
        + ". Compare one campaign at a time (give its folder), or pass --by-campaign to compare them "
        "as separate arms"
    )


def select_runs(
    runs: Sequence[RunRecord], by_campaign: bool, on_warning: Callable[[str], None]
) -> list[RunRecord]:
    """The runs one comparison holds (module docstring); each run left out gets one line to
    ``on_warning``.

    Raises:
        UserError: runs of several campaigns without ``by_campaign``, or no run left.
    """
    bench = [r for r in runs if is_benchmark(r.summary)]
    if bench:
        on_warning(
            f"left out {len(bench)} train.mode=benchmark run(s) (a throughput measurement, never run "
            "to the target): " + ", ".join(str(r.path) for r in bench)
        )
    kept = [r for r in runs if not is_benchmark(r.summary)]
    if not kept:
        raise UserError("no run to compare: every run given is a train.mode=benchmark run")
    campaigns = [campaign_of(r.summary) for r in kept]
    if by_campaign:
        for run, campaign in zip(kept, campaigns):
            run.campaign = campaign_name(campaign)
    else:
        _refuse_mixed(kept, campaigns)
    for run in kept:
        seed = ((run.summary.get("config") or {}).get("train") or {}).get("seed")
        if seed is not None and not isinstance(seed, int):
            on_warning(
                f"{run.path}: train.seed {json.dumps(seed)[:40]} is not an integer: compared unpaired "
                "(paired with no other arm's seed)"
            )
    drop: set[int] = set()
    for group in group_runs(kept):
        first: dict[int, RunRecord] = {}
        for run, seed in zip(group.runs, group.seeds):
            if seed is None:
                continue
            if seed in first:
                on_warning(
                    f"{run.path}: left out: {group.label} seed {seed} is also '{first[seed].path}', "
                    "kept (one run per arm and seed: a seed counted twice would pair twice)"
                )
                drop.add(id(run))
            else:
                first[seed] = run
    return [r for r in kept if id(r) not in drop]
