"""The GPU check's report: the layout of ``gpu-report.json`` (every figure) and its targets.

``benchmarks/gpu_check.py`` rewrites the report whenever a step starts, reports a figure or ends, so a run
that is killed still leaves what it had measured; ``benchmarks/gpu_markdown.py`` renders it as markdown.
The targets (K-FAC at 10/100 within 1.2× of SGD on one GPU, the decomposition stage within 1.1× of bare
``torch.linalg.eigh``, the conv-factor dispatch picking the faster path on CUDA, plus: ``pytest -m gpu``
passes, the smoke recipes run on CUDA, ``memory_usage()`` accounts for the allocator's K-FAC memory) are
evaluated from the sections each time: ``pass``, ``fail`` or ``not-checked`` (a dry run on the CPU, or the
step did not produce the figure).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

JSON_NAME, MD_NAME = "gpu-report.json", "gpu-report.md"
#: Factor / decomposition intervals: the ImageNet cadence 10/100, and 50/500 (KAISA Table 2's F_freq /
#: K_freq for ResNet-50 and Mask R-CNN; TPDS Fig. 7 decomposes every 500).
CADENCES = ((10, 100), (50, 500))
WORKLOADS = ("resnet50", "bert_large")  # sections with a side-by-side measurement
#: Factor / decomposition interval of the measuring run (``benchmarks/gpu_measure.py``), and how a cadence's
#: time per step follows from its per-kind medians.
MEASURING_CADENCE = (2, 4)
FORMULA = "t(f/k) = [t_decomposition + (k/f - 1)·t_factor + (k - k/f)·t_plain] / k"
#: A section's status.
STATUSES = ("pending", "running", "ok", "failed", "timeout", "skipped", "interrupted")
#: memory_usage() must account for this share of the allocator's K-FAC delta (either way).
MEMORY_TOLERANCE = 0.10


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def new_report(
    sections: dict[str, str], dry_run: bool, command: str, time_limit_s: float | None
) -> dict:
    """A report with every section ``pending``; ``sections`` maps each step name to its title."""
    return {
        "kind": "kfac-bench gpu-check",
        "dry_run": dry_run,
        "status": "running",
        "started": now(),
        "updated": now(),
        "finished": None,
        "command": command,
        "time_limit_s": time_limit_s,
        "amortisation": {"measuring_cadence": list(MEASURING_CADENCE), "formula": FORMULA},
        "sections": {
            name: {"title": title, "status": "pending", "budget_s": None, "duration_s": None}
            | {"error": None, "data": {}}
            for name, title in sections.items()
        },
        "targets": [],
    }


# --------------------------------------------------------------------------------------------- targets


def get(data: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(data, dict):
            data = data.get(k)
        elif isinstance(data, list) and isinstance(k, int) and -len(data) <= k < len(data):
            data = data[k]
        else:
            return None
    return data


def cadence(section: dict, f: int, k: int) -> dict | None:
    rows = get(section, "data", "cadences") or []
    return next(
        (r for r in rows if (r["factor_update_steps"], r["inv_update_steps"]) == (f, k)), None
    )


def _at_most(limit: float) -> Callable[[Any], bool]:
    return lambda v: v <= limit


def _within(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: low <= v <= high


def _gpu_tests(section: dict) -> dict | None:
    d = section["data"]
    if "tests" not in d:
        return None
    return {k: d[k] for k in ("tests", "passed", "failures", "errors", "skipped")}


def _recipes(section: dict) -> dict | None:
    runs = section["data"].get("runs")
    if not runs:
        return None
    value = {name: bool(r.get("ok")) for name, r in runs.items()}
    if "collectives" in section["data"]:
        value["collectives"] = bool(section["data"]["collectives"].get("ok"))
    return value


def targets(report: dict) -> list[dict[str, Any]]:
    """Each target: name, description, threshold, value, status (pass / fail / not-checked), reason."""
    s = report["sections"]
    rn, mem = s["resnet50"], s["memory"]
    specs: list[tuple[str, str, str, str, Any, Callable[[Any], bool]]] = [
        (
            "resnet50_kfac_step_ratio_10_100",
            "ResNet-50 SGD + K-FAC step / SGD step at factors/decompositions every 10/100",
            "≤ 1.2",
            "resnet50",
            get(cadence(rn, 10, 100), "ratio"),
            _at_most(1.2),
        ),
        (
            "resnet50_decomposition_vs_eigh",
            "ResNet-50 decomposition stage / bare torch.linalg.eigh on the same factors",
            "≤ 1.1",
            "resnet50",
            get(rn, "data", "eigh_check", "ratio"),
            _at_most(1.1),
        ),
        (
            "conv_factor_dispatch",
            "conv A-factor dispatch picks the faster path for every ResNet-50 conv shape "
            "(paths within 10 % are a tie); value: shapes dispatched to the slower path",
            "0 mismatches",
            "resnet50",
            _dispatch_value(get(rn, "data", "conv_dispatch")),
            lambda v: v == [],
        ),
        (
            "gpu_tests",
            "pytest -m gpu: every test passes (none skipped on a GPU)",
            "0 failed, 0 skipped",
            "gpu_tests",
            _gpu_tests(s["gpu_tests"]),
            lambda v: v["failures"] + v["errors"] + v["skipped"] == 0 and v["passed"] > 0,
        ),
        (
            "recipes_on_cuda",
            "smoke recipes through the CLI exit 0 with a finished status; NCCL collectives at world 1",
            "all ok",
            "recipes",
            _recipes(s["recipes"]),
            lambda v: all(v.values()),
        ),
        (
            "memory_accounting",
            "engine memory_usage() / allocator delta (K-FAC arm minus SGD arm), ResNet-50",
            f"{1 - MEMORY_TOLERANCE:.1f}–{1 + MEMORY_TOLERANCE:.1f}",
            "memory",
            get(mem, "data", "memory", "ratio"),
            _within(1 - MEMORY_TOLERANCE, 1 + MEMORY_TOLERANCE),
        ),
    ]
    out = []
    for name, description, threshold, step, value, check in specs:
        if report["dry_run"]:
            status, reason = "not-checked", "dry run on the CPU: targets apply to one CUDA device"
        elif value is None:
            status, reason = "not-checked", f"no figure: step {step} is {s[step]['status']}"
        else:
            status, reason = ("pass" if check(value) else "fail"), None
        out.append(
            {"name": name, "description": description, "threshold": threshold, "value": value}
            | {"status": status, "reason": reason}
        )
    return out


def _dispatch_value(d: dict | None) -> list[str] | None:
    if d is None or d["shapes_measured"] < d["shapes"] or d["shapes_failed"]:
        return None  # not every shape was timed: no verdict
    return list(d["mismatches"])
