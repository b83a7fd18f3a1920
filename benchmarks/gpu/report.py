"""The GPU check's report: the layout of ``gpu-report.json`` (every figure), its targets and its markdown.

The check rewrites the report whenever a step starts, reports a figure or ends, so a run that is killed still
leaves what it had measured. The targets (K-FAC at 10/100 within 1.2× of SGD on one GPU, the decomposition
stage within 1.1× of bare ``torch.linalg.eigh``, the conv-factor dispatch picking the faster path on CUDA,
plus: ``pytest -m gpu`` passes, the smoke recipes run on CUDA, ``memory_usage()`` accounts for the
allocator's K-FAC memory) are evaluated from the sections each time: ``pass``, ``fail`` or ``not-checked``
(a dry run on the CPU, or the step did not produce the figure). ``gpu-report.md`` renders it as tables, the
step-time rows ready to quote. Nothing here imports torch: the check renders reports without it.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

JSON_NAME, MD_NAME = "gpu-report.json", "gpu-report.md"
#: Factor / decomposition intervals: the ImageNet cadence 10/100, and 50/500 (KAISA Table 2's F_freq /
#: K_freq for ResNet-50 and Mask R-CNN; TPDS Fig. 7 decomposes every 500).
CADENCES = ((10, 100), (50, 500))
WORKLOADS = ("resnet50", "bert_large")  # sections with a side-by-side measurement
#: Factor / decomposition interval of the measuring run (``benchmarks/gpu/measure.py``), and how a
#: cadence's time per step follows from its per-kind medians.
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
    section = {"status": "pending", "budget_s": None, "duration_s": None, "error": None}
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
        "sections": {n: {"title": t, **section, "data": {}} for n, t in sections.items()},
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


def _gpu_tests(section: dict) -> dict | None:
    d = section["data"]
    return (
        {k: d[k] for k in ("tests", "passed", "failures", "errors", "skipped")}
        if "tests" in d
        else None
    )


def _recipes(section: dict) -> dict | None:
    runs = section["data"].get("runs")
    if not runs:
        return None
    value = {name: bool(r.get("ok")) for name, r in runs.items()}
    if "collectives" in section["data"]:
        value["collectives"] = bool(section["data"]["collectives"].get("ok"))
    return value


def _dispatch(d: dict | None) -> list[str] | None:
    if d is None or d["shapes_measured"] < d["shapes"] or d["shapes_failed"]:
        return None  # not every shape was timed: no verdict
    return list(d["mismatches"])


def targets(report: dict) -> list[dict[str, Any]]:
    """Each target: name, description, threshold, value, status (pass / fail / not-checked), reason."""
    s = report["sections"]
    rn, low, high = s["resnet50"], 1 - MEMORY_TOLERANCE, 1 + MEMORY_TOLERANCE
    specs: list[tuple[str, str, str, str, Any, Callable[[Any], bool]]] = [
        (
            "resnet50_kfac_step_ratio_10_100",
            "ResNet-50 SGD + K-FAC step / SGD step at factors/decompositions every 10/100",
            "≤ 1.2",
            "resnet50",
            get(cadence(rn, 10, 100), "ratio"),
            lambda v: v <= 1.2,
        ),
        (
            "resnet50_decomposition_vs_eigh",
            "ResNet-50 decomposition stage / bare torch.linalg.eigh on the same factors",
            "≤ 1.1",
            "resnet50",
            get(rn, "data", "eigh_check", "ratio"),
            lambda v: v <= 1.1,
        ),
        (
            "conv_factor_dispatch",
            "conv A-factor dispatch picks the faster path for every ResNet-50 conv shape "
            "(paths within 10 % are a tie); value: shapes dispatched to the slower path",
            "0 mismatches",
            "resnet50",
            _dispatch(get(rn, "data", "conv_dispatch")),
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
            f"{low:.1f}–{high:.1f}",
            "memory",
            get(s["memory"], "data", "memory", "ratio"),
            lambda v: low <= v <= high,
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


# -------------------------------------------------------------------------------------------- markdown


def _n(x: Any, fmt: str = ".4g") -> str:
    return "–" if x is None else format(x, fmt)


def _mib(x: Any) -> str:
    return "–" if x is None else f"{x / 2**20:.1f}"


def _table(head: str, rows: list[list[str]]) -> list[str]:
    """A markdown table: ``head`` is the column titles separated by ``|``."""
    cols = head.split("|")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def _short(section: dict) -> str:
    return str(section["title"]).split(":")[0]


def step_time_rows(report: dict) -> list[list[str]]:
    """The rows of the step-time table (SGD and K-FAC seconds per step, their ratio, main stages)."""
    rows = []
    for name in WORKLOADS:
        sec = report["sections"][name]
        label = get(sec, "data", "workload", "label") or sec["title"]
        for f, k in CADENCES:
            r = cadence(sec, f, k)
            if r is None:
                continue
            st = r["stages_s_per_step"]
            main = ", ".join(
                f"{n} {st[n]:.4g}" for n in ("factor", "decomposition", "precondition", "kl_clip")
            )
            main += f"; factor hooks {r['factor_hooks_s_per_step']:.4g}"
            ratio = f"**{r['ratio']:.2f}×**"
            rows.append(
                [label, f"{f} / {k}", _n(r["sgd_step_s"]), _n(r["kfac_step_s"]), ratio, main]
            )
    return rows


def _stage_rows(report: dict) -> tuple[str, list[list[str]]]:
    """TPDS Fig. 7's stages: ms per occurrence and ms per step at each cadence, per workload."""
    head, cols = "stage", []
    for name in WORKLOADS:
        sec = report["sections"][name]
        if "per_kind" not in sec["data"]:
            continue
        short = _short(sec)
        head += f"|{short} ms per occurrence" + "".join(
            f"|{short} ms/step at {f}/{k}" for f, k in CADENCES
        )
        cols.append((sec["data"]["per_kind"], [cadence(sec, f, k) for f, k in CADENCES]))
    kind_of = {"factor": "factor", "factor_comm": "factor", "factor_hooks": "factor"}
    kind_of |= {"decomposition": "decomposition", "decomposition_comm": "decomposition"}
    rows: list[list[str]] = []
    if not cols:
        return head, rows
    # The engine's stages (kfac_bench.kfac.STAGES), in its order, as the measuring step recorded them.
    for st in (*cols[0][0]["plain"]["stages_s"], "factor_hooks"):
        hooks = st == "factor_hooks"
        row = ["factor (hooks, device time by difference)" if hooks else st]
        for kinds, cad in cols:
            k = kinds[kind_of.get(st, "plain")]
            occ = (
                k["kfac_forward_backward_s"] - k["sgd_forward_backward_s"]
                if hooks
                else k["stages_s"][st]
            )
            row.append(_n(occ * 1e3, ".3g"))
            for r in cad:
                v = (
                    None
                    if r is None
                    else r["factor_hooks_s_per_step"]
                    if hooks
                    else r["stages_s_per_step"][st]
                )
                row.append(_n(None if v is None else v * 1e3, ".3g"))
        rows.append(row)
    return head, rows


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "–" if v is None else json.dumps(v)


def markdown(report: dict) -> str:
    s = report["sections"]
    env = s["environment"]["data"].get("environment", {})
    lines = [f"# kfac-bench GPU check: {env.get('device_name') or '?'}", ""]
    if report["dry_run"]:
        lines += [
            "**Dry run on the CPU at tiny sizes**: the figures show that every step runs and reports, not "
            "GPU performance; targets are not checked.",
            "",
        ]
    lines += [
        f"Run {report['started']} (report updated {report['updated']}, status {report['status']}); "
        f"torch {env.get('torch') or '?'}, CUDA {env.get('cuda') or '–'}, "
        f"cuDNN {env.get('cudnn') or '–'}, NCCL {env.get('nccl') or '–'}, "
        f"driver {env.get('driver') or '–'}, {_mib(env.get('device_memory_bytes'))} MiB device memory.",
        "",
        "## Targets",
        "",
    ]
    tgt = [
        [t["name"], t["threshold"], _fmt_value(t["value"]), f"**{t['status']}**", t["reason"] or ""]
        for t in report["targets"]
    ]
    lines += _table("target|threshold|value|status|note", tgt)
    steps = []
    for n, sec in s.items():
        error = (sec["error"] or "").splitlines()[-1][:120] if sec["error"] else ""
        steps.append(
            [
                n,
                sec["title"],
                sec["status"],
                _n(sec["duration_s"], ".1f"),
                _n(sec["budget_s"], ".0f"),
                error,
            ]
        )
    lines += ["## Steps", "", *_table("step|what|status|time s|budget s|error", steps)]
    lines += ["## Step time: SGD vs SGD + K-FAC, side by side", ""]
    head = "workload|cadence (factors / decompositions)|SGD s/step|K-FAC s/step|ratio"
    lines += _table(head + "|main K-FAC stages (s/step)", step_time_rows(report))
    lines += [f"Amortised from per-kind medians: {FORMULA}.", ""]
    for name in WORKLOADS:
        d = s[name]["data"]
        if "factor_dtypes" in d:
            lines += [
                f"{_short(s[name])}: {d.get('layers')} K-FAC layers, measuring windows: "
                f"{d.get('windows')}; factor dtypes under autocast: {', '.join(d['factor_dtypes'])} "
                "(float32 expected).",
                "",
            ]
    head, rows = _stage_rows(report)
    lines += ["## Stage breakdown (the shape of TPDS Fig. 7)", "", *_table(head, rows)]
    return "\n".join(lines + _checks(s)) + "\n"


def _checks(s: dict) -> list[str]:
    rows = []
    for name in WORKLOADS:
        if e := get(s[name], "data", "eigh_check"):
            rows.append(
                [_short(s[name]), _n(e["stage_s"]), _n(e["bare_eigh_s"]), f"{e['ratio']:.2f}×"]
            )
    lines = ["## Decomposition stage vs bare eigh", ""]
    lines += _table("workload|decomposition stage s|bare eigh s|ratio", rows)
    lines += ["## Conv A-factor dispatch", ""]
    if d := get(s["resnet50"], "data", "conv_dispatch"):
        lines += [
            f"{d['shapes_measured']} of {d['shapes']} shapes timed; slower path chosen for: "
            f"{', '.join(d['mismatches']) or 'none'}; network total {_n(d['network_chosen_ms'])} ms "
            f"as dispatched vs {_n(d['network_best_ms'])} ms with the faster path everywhere.",
            "",
        ]
        rows = [
            [r["layer"], str(r["count"]), r.get("chosen", "–")]
            + [_n(r.get(k)) for k in ("shift_ms", "unfold_ms", "dispatched_ms")]
            + [("ok" if r["ok"] else "**slower**") if "ok" in r else r.get("error", "")]
            for r in d["rows"]
        ]
        lines += _table("layer|n|dispatch|shift ms|unfold ms|dispatched ms|verdict", rows)
    lines += ["## Memory (ResNet-50 K-FAC arm minus SGD arm)", ""]
    if m := get(s["memory"], "data", "memory"):
        e = m["engine_memory_usage"]
        row = [_mib(e[k]) for k in ("total", "factors", "decompositions")]
        row += [
            _mib(m["allocated_delta_bytes"]),
            _mib(m["peak_delta_bytes"]),
            _n(m["ratio"], ".3f"),
        ]
        head = "memory_usage() MiB|factors|decompositions|allocated delta MiB|peak delta MiB|ratio"
        lines += _table(head, [row])
    if (o := get(s.get("ops", {}), "data", "ops")) and "table" in o:
        lines += [
            "## Compute ops and CUDA kernel launches per step (benchmarks/ops.py)",
            "",
            "```",
            o["table"],
            "```",
            "",
        ]
    runs = get(s["recipes"], "data", "runs") or {}
    rows = [
        [
            n,
            str(r.get("exit_status")),
            _n(r.get("wall_s"), ".1f"),
            str(r.get("status")),
            str(r.get("steps")),
            _n(r.get("mean_step_time_s")),
            str(r.get("world_size")),
        ]
        for n, r in runs.items()
    ]
    lines += ["## Smoke recipes through the CLI", ""]
    lines += _table("run|exit|wall s|status|steps|mean step s|world", rows)
    if c := get(s["recipes"], "data", "collectives"):
        lines += [f"Collectives probe: {json.dumps(c)}", ""]
    t = s["gpu_tests"]["data"]
    if "tests" in t:
        lines += [
            "## pytest -m gpu",
            "",
            f"{t['passed']} passed, {t['failures']} failed, "
            f"{t['errors']} errors, {t['skipped']} skipped of {t['tests']}.",
            "",
        ]
    return lines
