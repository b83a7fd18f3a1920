"""``gpu-report.md``: the GPU check's report as tables, the step-time rows ready for the README's
Performance section (``benchmarks/gpu_report.py`` holds the figures and targets)."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.gpu_report import CADENCES, FORMULA, WORKLOADS, cadence, get


def _n(x: Any, fmt: str = ".4g") -> str:
    return "–" if x is None else format(x, fmt)


def _mib(x: Any) -> str:
    return "–" if x is None else f"{x / 2**20:.1f}"


def step_time_rows(report: dict) -> list[list[str]]:
    """The rows of the step-time table (the ones the README's Performance section quotes)."""
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
                f"{st_name} {st[st_name]:.4g}"
                for st_name in ("factor", "decomposition", "precondition", "kl_clip")
            )
            rows.append(
                [
                    label,
                    f"{f} / {k}",
                    _n(r["sgd_step_s"]),
                    _n(r["kfac_step_s"]),
                    f"**{r['ratio']:.2f}×**",
                    f"{main}; factor hooks {r['factor_hooks_s_per_step']:.4g}",
                ]
            )
    return rows


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def _stage_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """TPDS Fig. 7's stages: ms per occurrence and ms per step at each cadence, per workload."""
    head, cols = ["stage"], []
    for name in WORKLOADS:
        d = report["sections"][name]["data"]
        if "per_kind" not in d:
            continue
        short = _short(report["sections"][name])
        head += [f"{short} ms per occurrence"] + [
            f"{short} ms/step at {f}/{k}" for f, k in CADENCES
        ]
        cols.append((d["per_kind"], [cadence(report["sections"][name], f, k) for f, k in CADENCES]))
    where = {"factor": "factor", "factor_comm": "factor", "decomposition": "decomposition"}
    where["decomposition_comm"] = "decomposition"
    rows: list[list[str]] = []
    if not cols:
        return head, rows
    # The engine's stages (kfac_bench.kfac.STAGES), in its order, as the measuring step recorded them: the
    # check itself renders reports without importing torch.
    stages = list(cols[0][0]["plain"]["stages_s"])
    for st in (*stages, "factor_hooks"):
        label = "factor (hooks, device time by difference)" if st == "factor_hooks" else st
        row = [label]
        for kinds, cad in cols:
            k = kinds[where.get(st, "plain" if st != "factor_hooks" else "factor")]
            occ = (
                k["kfac_forward_backward_s"] - k["sgd_forward_backward_s"]
                if st == "factor_hooks"
                else k["stages_s"][st]
            )
            row.append(_n(occ * 1e3, ".3g"))
            for r in cad:
                key = "factor_hooks_s_per_step" if st == "factor_hooks" else None
                v = None if r is None else (r[key] if key else r["stages_s_per_step"][st])
                row.append(_n(None if v is None else v * 1e3, ".3g"))
        rows.append(row)
    return head, rows


def markdown(report: dict) -> str:
    s = report["sections"]
    env = s["environment"]["data"].get("environment", {})
    device = env.get("device_name") or "?"
    lines = [f"# kfac-bench GPU check: {device}", ""]
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
        f"driver {env.get('driver') or '–'}, "
        f"{_mib(env.get('device_memory_bytes'))} MiB device memory.",
        "",
        "## Targets",
        "",
    ]
    tgt = [
        [t["name"], t["threshold"], _fmt_value(t["value"]), f"**{t['status']}**", t["reason"] or ""]
        for t in report["targets"]
    ]
    lines += _table(["target", "threshold", "value", "status", "note"], tgt)
    lines += ["## Steps", ""]
    steps = [
        [
            n,
            sec["title"],
            sec["status"],
            _n(sec["duration_s"], ".1f"),
            _n(sec["budget_s"], ".0f"),
            (sec["error"] or "").splitlines()[-1][:120] if sec["error"] else "",
        ]
        for n, sec in s.items()
    ]
    lines += _table(["step", "what", "status", "time s", "budget s", "error"], steps)
    lines += ["## Step time: SGD vs SGD + K-FAC, side by side (README Performance rows)", ""]
    lines += _table(
        [
            "workload",
            "cadence (factors / decompositions)",
            "SGD s/step",
            "K-FAC s/step",
            "ratio",
            "main K-FAC stages (s/step)",
        ],
        step_time_rows(report),
    )
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
    lines += _checks(report)
    return "\n".join(lines) + "\n"


def _short(section: dict) -> str:
    return str(section["title"]).split(":")[0]


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "–" if v is None else json.dumps(v)


def _checks(report: dict) -> list[str]:
    s = report["sections"]
    lines = ["## Decomposition stage vs bare eigh", ""]
    rows = []
    for name in WORKLOADS:
        e = get(s[name], "data", "eigh_check")
        if e:
            rows.append(
                [_short(s[name]), _n(e["stage_s"]), _n(e["bare_eigh_s"]), f"{e['ratio']:.2f}×"]
            )
    lines += _table(["workload", "decomposition stage s", "bare eigh s", "ratio"], rows)
    d = get(s["resnet50"], "data", "conv_dispatch")
    lines += ["## Conv A-factor dispatch", ""]
    if d:
        lines += [
            f"{d['shapes_measured']} of {d['shapes']} shapes timed; slower path chosen for: "
            f"{', '.join(d['mismatches']) or 'none'}; network total {_n(d['network_chosen_ms'])} ms "
            f"as dispatched vs {_n(d['network_best_ms'])} ms with the faster path everywhere.",
            "",
        ]
        rows = [
            [
                r["layer"],
                str(r["count"]),
                r.get("chosen", "–"),
                _n(r.get("shift_ms")),
                _n(r.get("unfold_ms")),
                _n(r.get("dispatched_ms")),
                ("ok" if r["ok"] else "**slower**") if "ok" in r else r.get("error", ""),
            ]
            for r in d["rows"]
        ]
        lines += _table(
            ["layer", "n", "dispatch", "shift ms", "unfold ms", "dispatched ms", "verdict"], rows
        )
    m = get(s["memory"], "data", "memory")
    lines += ["## Memory (ResNet-50 K-FAC arm minus SGD arm)", ""]
    if m:
        e = m["engine_memory_usage"]
        lines += _table(
            [
                "memory_usage() MiB",
                "factors",
                "decompositions",
                "allocated delta MiB",
                "peak delta MiB",
                "ratio",
            ],
            [
                [
                    _mib(e["total"]),
                    _mib(e["factors"]),
                    _mib(e["decompositions"]),
                    _mib(m["allocated_delta_bytes"]),
                    _mib(m["peak_delta_bytes"]),
                    _n(m["ratio"], ".3f"),
                ]
            ],
        )
    runs = get(s["recipes"], "data", "runs") or {}
    lines += ["## Smoke recipes through the CLI", ""]
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
    lines += _table(["run", "exit", "wall s", "status", "steps", "mean step s", "world"], rows)
    c = get(s["recipes"], "data", "collectives")
    if c:
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
