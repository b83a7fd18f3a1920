"""The GPU check: its measurements (in process, float32 on the CPU), its targets and markdown, and the real
``python -m benchmarks.gpu --dry-run`` in a subprocess (every step, report files, failure handling)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.conv_factor import ConvShape
from benchmarks.gpu import profile as gpu_profile
from benchmarks.gpu import report as gpu_report
from benchmarks.gpu.check import REPO, STEPS, child_env, write_report
from benchmarks.gpu.measure import (
    amortise,
    conv_dispatch,
    conv_shapes,
    memory_figures,
    side_by_side,
    step_kind,
)
from benchmarks.training_step import Setup, classification
from kfac_bench.kfac import STAGES
from kfac_bench.kfac.layers.conv_unfold import fast_method
from kfac_bench.plan.stage_profile import load_profile
from tests.limits import hang_limit

SECTIONS = ("environment", "gpu_tests", "resnet50", "memory", "bert_large", "ops", "recipes")


def _tiny_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


def _tiny_workload() -> Any:
    return classification("tiny", _tiny_cnn, (8, 3, 8, 8), 5)


# ------------------------------------------------------------------------------------- measurements


def test_amortisation_formula_by_hand() -> None:
    kinds = {"decomposition": 10.0, "factor": 2.0, "plain": 1.0}
    # 10/100: 1 decomposition step, 9 factor steps, 90 plain steps.
    assert amortise(kinds, 10, 100) == pytest.approx((10 + 9 * 2 + 90 * 1) / 100)
    assert amortise(kinds, 50, 500) == pytest.approx((10 + 9 * 2 + 490 * 1) / 500)
    # The measuring cadence itself: the plain mean of one window of 4 steps.
    assert [step_kind(i) for i in range(4)] == ["decomposition", "plain", "factor", "plain"]
    assert amortise(kinds, 2, 4) == pytest.approx((10 + 1 + 2 + 1) / 4)
    with pytest.raises(ValueError, match="divide"):
        amortise(kinds, 3, 100)


def _side_by_side(setup: Setup, windows: int = 2) -> dict[str, Any]:
    torch.manual_seed(0)
    data: dict[str, Any] = {}
    cadences = [(10, 100), (50, 500)]
    side_by_side(
        _tiny_workload(), setup, cadences, windows, time.monotonic() + 600, data.__setitem__
    )
    return data


def test_side_by_side_counts_step_kinds_and_amortises_them() -> None:
    data = _side_by_side(Setup())
    kinds = data["per_kind"]
    assert data["windows"] == 2 and data["layers"] == 3
    assert {k: v["count"] for k, v in kinds.items()} == {
        "decomposition": 2,
        "factor": 2,
        "plain": 4,
    }
    # The engine's stages happen on the step kinds the cadence says, and only there.
    assert kinds["decomposition"]["stages_s"]["decomposition"] > 0
    assert kinds["factor"]["stages_s"]["decomposition"] == 0
    assert kinds["factor"]["stages_s"]["factor"] > 0 and kinds["plain"]["stages_s"]["factor"] == 0
    assert all(kinds[k]["stages_s"]["precondition"] > 0 for k in kinds)
    assert data["factor_dtypes"] == ["torch.float32"]
    for row, (f, k) in zip(data["cadences"], [(10, 100), (50, 500)]):
        assert (row["factor_update_steps"], row["inv_update_steps"]) == (f, k)
        per_kind = {name: v["kfac_step_s"] for name, v in kinds.items()}
        assert row["kfac_step_s"] == pytest.approx(amortise(per_kind, f, k))
        assert row["ratio"] == pytest.approx(row["kfac_step_s"] / row["sgd_step_s"])
        assert set(row["stages_s_per_step"]) == set(STAGES)
    e = data["eigh_check"]
    assert e["bare_eigh_s"] > 0 and e["ratio"] == pytest.approx(e["stage_s"] / e["bare_eigh_s"])
    assert e["stage_s"] == kinds["decomposition"]["stages_s"]["decomposition"]


def test_the_resnet50_stages_become_a_plan_profile(tmp_path: Path) -> None:
    data = _side_by_side(Setup())
    data["workload"] = {
        "label": "tiny",
        "model": "torchvision resnet50",
        "batch": 8,
        "precision": "fp32",
    }
    report = gpu_report.new_report({n: n for n in SECTIONS}, False, "test", None)
    assert gpu_profile.profile_text(report) is None  # nothing measured yet
    report["sections"]["resnet50"]["data"] = {**data, "workload": {"label": "no batch yet"}}
    assert gpu_profile.profile_text(report) is None  # the report is rewritten as figures arrive
    report["sections"]["resnet50"]["data"] = data
    path = tmp_path / gpu_profile.NAME
    path.write_text(gpu_profile.profile_text(report) or "")
    profile = load_profile(path)
    kinds = data["per_kind"]
    assert profile.model == "resnet50" and profile.precision == "fp32"
    assert vars(profile.measured_at) == {
        "world_size": 1,
        "batch_size": 8,
        "grad_workers": 1,
        "placement": "lpt",
    }
    assert profile.baseline_step_s == kinds["plain"]["sgd_step_s"]
    stages = profile.stages_s
    assert stages["decomposition"] == kinds["decomposition"]["stages_s"]["decomposition"]
    assert stages["precondition"] == kinds["plain"]["stages_s"]["precondition"]
    assert stages["kl_clip"] == kinds["plain"]["stages_s"]["kl_clip"]

    def hooks(kind: str) -> float:
        k = kinds[kind]
        return k["kfac_forward_backward_s"] - k["sgd_forward_backward_s"]

    assert stages["factor"] == pytest.approx(max(0.0, hooks("factor") - hooks("plain")))
    assert set(profile.sources) == {"baseline_step_s", *(f"stages_s.{k}" for k in stages)}
    assert profile.bandwidth_bytes is None  # one device: the planner models the network


def test_side_by_side_runs_float16_autocast_with_grad_scalers() -> None:
    # A Linear-only model: the CPU rehearsal of BERT's fp16 + GradScaler path in both arms.
    w = classification(
        "mlp", lambda: nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)), (8, 12), 3
    )
    data: dict[str, Any] = {}
    setup = Setup(amp_dtype=torch.float16, grad_scaler=True)
    side_by_side(w, setup, [(10, 100)], 1, time.monotonic() + 600, data.__setitem__)
    assert data["cadences"][0]["sgd_step_s"] > 0 and data["cadences"][0]["kfac_step_s"] > 0
    assert data["layers"] == 2 and data["factor_dtypes"]


def test_conv_shapes_are_the_model_inputs() -> None:
    shapes = conv_shapes(_tiny_cnn(), 8, batch=16)
    assert shapes == {
        ConvShape(16, 3, 8, 3, 1, 1, True): 1,
        ConvShape(16, 4, 8, 3, 2, 1, True): 1,
    }


def test_conv_dispatch_times_both_paths_and_judges_the_choice() -> None:
    shapes = conv_shapes(_tiny_cnn(), 8, batch=4)
    data: dict[str, Any] = {}
    conv_dispatch(shapes, Setup(), 2, time.monotonic() + 600, data.__setitem__)
    d = data["conv_dispatch"]
    assert d["shapes"] == d["shapes_measured"] == 2 and d["shapes_failed"] == 0
    for row, shape in zip(d["rows"], sorted(shapes, key=lambda s: -s.channels * s.size**2)):
        x = torch.zeros(shape.batch, shape.channels, shape.size, shape.size)
        assert row["chosen"] == fast_method(x, *shape.args()[:4])
        faster = "shift" if row["shift_ms"] <= row["unfold_ms"] else "unfold"
        assert row["faster"] == faster and row["ok"] == (row["tie"] or row["chosen"] == faster)
        assert row["dispatched_ms"] > 0
    assert d["mismatches"] == [r["layer"] for r in d["rows"] if not r["ok"]]
    assert d["network_best_ms"] <= d["network_chosen_ms"]


def test_memory_on_the_cpu_reports_the_engine_figures_only() -> None:
    data: dict[str, Any] = {}
    memory_figures(_tiny_workload(), Setup(), 2, data.__setitem__)
    m = data["memory"]
    e = m["engine_memory_usage"]
    assert e["total"] == e["factors"] + e["decompositions"] + e["buffers"] > 0
    # Three layers' A and G factors in float32: (28² + 4²) + (37² + 4²) + (65² + 5²) elements.
    assert e["factors"] == 4 * (28**2 + 4**2 + 37**2 + 4**2 + 65**2 + 5**2)
    assert m["allocated_delta_bytes"] is None and m["ratio"] is None and m["layers"] == 3


# ------------------------------------------------------------------------------- targets and markdown


def _report(dry: bool = False) -> dict[str, Any]:
    return gpu_report.new_report({n: STEPS[n][0] for n in STEPS}, dry, "test", 450)


def _by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in gpu_report.targets(report)}


def test_targets_pass_fail_and_not_checked() -> None:
    r = _report()
    rn = r["sections"]["resnet50"]
    rn["status"] = "ok"
    rn["data"] = {
        "cadences": [{"factor_update_steps": 10, "inv_update_steps": 100, "ratio": 1.15}],
        "eigh_check": {"ratio": 1.25},
        "conv_dispatch": {"shapes": 3, "shapes_measured": 2, "shapes_failed": 0, "mismatches": []},
    }
    r["sections"]["gpu_tests"]["data"] = dict(tests=5, passed=4, failures=0, errors=0, skipped=1)
    r["sections"]["memory"] |= {"status": "timeout", "data": {}}
    t = _by_name(r)
    assert t["resnet50_kfac_step_ratio_10_100"]["status"] == "pass"
    assert t["resnet50_decomposition_vs_eigh"]["status"] == "fail"
    assert t["conv_factor_dispatch"]["status"] == "not-checked"  # one shape was not timed
    assert t["gpu_tests"]["status"] == "fail"  # a GPU test skipped on a GPU
    assert t["memory_accounting"]["status"] == "not-checked"
    assert "timeout" in t["memory_accounting"]["reason"]
    rn["data"]["conv_dispatch"]["shapes_measured"] = 3
    assert _by_name(r)["conv_factor_dispatch"]["status"] == "pass"
    rn["data"]["conv_dispatch"]["mismatches"] = ["64ch@56² k3 s1"]
    assert _by_name(r)["conv_factor_dispatch"]["status"] == "fail"
    r["dry_run"] = True
    assert {x["status"] for x in gpu_report.targets(r)} == {"not-checked"}


def _cells(md: str, heading: str) -> list[list[str]]:
    """The body rows of the first table after ``heading``."""
    block = md.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def test_markdown_has_the_rows_the_readme_quotes_with_the_json_figures(tmp_path: Path) -> None:
    r = _report()
    measured = _side_by_side(Setup(), windows=1)
    for name, label in (
        ("resnet50", "ResNet-50, 224², batch 64"),
        ("bert_large", "BERT-Large, seq 512"),
    ):
        r["sections"][name] |= {"status": "ok", "data": measured | {"workload": {"label": label}}}
    write_report(r, tmp_path)
    md = (tmp_path / gpu_report.MD_NAME).read_text()
    assert json.loads((tmp_path / gpu_report.JSON_NAME).read_text())["targets"]
    rows = _cells(md, "## Step time")
    for label in ("ResNet-50", "BERT-Large"):
        for row, cadence in zip((x for x in rows if x[0].startswith(label)), measured["cadences"]):
            assert row[1] == f"{cadence['factor_update_steps']} / {cadence['inv_update_steps']}"
            assert float(row[2]) == pytest.approx(cadence["sgd_step_s"], rel=1e-3)
            assert float(row[3]) == pytest.approx(cadence["kfac_step_s"], rel=1e-3)
            assert row[4] == f"**{cadence['ratio']:.2f}×**"
    assert len(rows) == 4
    stages = _cells(md, "## Stage breakdown")
    assert [s[0] for s in stages][:-1] == list(STAGES) and len(stages[0]) == 1 + 2 * 3
    occurrence = measured["per_kind"]["decomposition"]["stages_s"]["decomposition"] * 1e3
    assert float(stages[STAGES.index("decomposition")][1]) == pytest.approx(occurrence, rel=1e-2)
    targets = _cells(md, "## Targets")
    assert [t[0] for t in targets] == [t["name"] for t in gpu_report.targets(r)]
    assert "**pass**" in targets[0][3] or "**fail**" in targets[0][3]


# ----------------------------------------------------------------------------------- the real command


def _dry_run(tmp_path: Path, *args: str, timeout: float = 900) -> tuple[int, dict[str, Any], str]:
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out", str(tmp_path), *args]
    done = subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=hang_limit(timeout)
    )
    report = json.loads((tmp_path / gpu_report.JSON_NAME).read_text())
    return done.returncode, report, (tmp_path / gpu_report.MD_NAME).read_text()


def _check_measured(name: str, data: dict[str, Any]) -> None:
    if name in ("resnet50", "bert_large"):
        assert [(c["factor_update_steps"], c["inv_update_steps"]) for c in data["cadences"]] == [
            (10, 100),
            (50, 500),
        ]
        assert all(isinstance(c["ratio"], float) and c["ratio"] > 0 for c in data["cadences"])
        assert isinstance(data["eigh_check"]["ratio"], float) and data["workload"]["label"]
    if name == "resnet50":
        d = data["conv_dispatch"]
        assert d["shapes_measured"] == d["shapes"] > 0 and isinstance(d["network_ratio"], float)
    if name == "memory":
        m = data["memory"]
        assert (
            isinstance(m["engine_memory_usage"]["total"], int)
            and m["allocated_delta_bytes"] is None
        )


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    code, report, md = _dry_run(tmp_path, "--skip", "recipes")
    s = report["sections"]
    assert tuple(s) == SECTIONS and report["dry_run"] and report["status"] == "complete"
    assert all(sec["status"] in gpu_report.STATUSES for sec in s.values())
    assert s["recipes"]["status"] == "skipped"
    env = s["environment"]
    assert env["status"] == "ok" and env["data"]["environment"]["dry_run"] is True
    assert isinstance(env["data"]["environment"]["torch"], str)
    t = s["gpu_tests"]
    assert t["status"] == "ok" and t["data"]["files"] and t["data"]["exit_status"] == 0
    d = t["data"]
    assert d["tests"] == d["passed"] + d["failures"] + d["errors"] + d["skipped"] > 0
    if not torch.cuda.is_available():
        assert d["skipped"] == d["tests"]
    assert {x["status"] for x in report["targets"]} == {"not-checked"}
    for heading in ("## Targets", "## Steps", "## Step time", "## Stage breakdown", "## Memory"):
        assert heading in md
    for name in ("resnet50", "bert_large", "memory"):
        # The engine computes factors outside autocast (bf16 ResNet-50, fp16 BERT): every step measures.
        assert s[name]["status"] == "ok", (name, s[name]["status"], s[name]["error"])
        _check_measured(name, s[name]["data"])
    # Compute ops per step by stage, SGD and K-FAC side by side.
    ops = s["ops"]
    assert ops["status"] == "ok", ops["error"]
    arms = ops["data"]["ops"]["arms"]
    assert set(arms) == {"sgd", "ours"} and arms["ours"]["extra"] > 0
    assert "cuda_kernels" not in arms["ours"]  # a dry run measures on the CPU
    assert "## Compute ops and CUDA kernel launches" in md
    # The ResNet-50 stages as a plan profile, readable by kfac-bench plan (a CIFAR ResNet-8 in a dry run).
    profile = load_profile(tmp_path / gpu_profile.NAME)
    kinds = s["resnet50"]["data"]["per_kind"]
    assert profile.baseline_step_s == kinds["plain"]["sgd_step_s"]
    assert profile.model == "CIFAR ResNet-8" and "dry run" in profile.device
    assert code == 0


def test_a_failing_step_is_recorded_and_the_next_still_runs(tmp_path: Path) -> None:
    code, report, md = _dry_run(
        tmp_path, "--only", "environment", "gpu_tests", "--fail-step", "environment"
    )
    s = report["sections"]
    assert code == 1
    assert s["environment"]["status"] == "failed"
    assert "failure injected by --fail-step environment" in s["environment"]["error"]
    assert s["gpu_tests"]["status"] == "ok" and s["gpu_tests"]["data"]["tests"] > 0
    steps = {row[0]: row for row in _cells(md, "## Steps")}
    assert steps["environment"][2] == "failed" and steps["gpu_tests"][2] == "ok"
    assert steps["resnet50"][2] == "skipped"


def test_a_hanging_step_is_killed_at_its_budget_and_keeps_its_first_figures(tmp_path: Path) -> None:
    # The environment step records the host's facts before it imports torch, then hangs (a budget of 7 s:
    # the step's least time is 5 s).
    code, report, _ = _dry_run(
        tmp_path, "--only", "environment", "--hang-step", "environment", "--time-limit", "7"
    )
    env = report["sections"]["environment"]
    assert code == 1 and env["status"] == "timeout" and 5 < env["budget_s"] <= 7
    assert set(env["data"]) == {"environment"}  # recorded before the hang
    assert env["data"]["environment"]["dry_run"] is True
    assert "torch" not in env["data"]["environment"]  # the hang came before the second record


def test_steps_that_cannot_get_their_least_time_are_skipped(tmp_path: Path) -> None:
    code, report, _ = _dry_run(tmp_path, "--only", "environment", "gpu_tests", "--time-limit", "10")
    s = report["sections"]
    assert code == 1
    assert s["environment"]["status"] == "skipped" and "out of time" in s["environment"]["error"]
    assert s["gpu_tests"]["status"] == "skipped"


@pytest.mark.slow
def test_dry_run_recipes_through_the_cli_and_torchrun(tmp_path: Path) -> None:
    _code, report, md = _dry_run(tmp_path, "--only", "recipes")
    rec = report["sections"]["recipes"]
    assert rec["status"] == "ok", rec["error"]
    runs = rec["data"]["runs"]
    assert set(runs) == {"maskrcnn", "bert", "bert_torchrun"}
    for name, run in runs.items():
        assert run["ok"] and run["exit_status"] == 0, (name, run.get("output_tail"))
        assert run["steps"] == 2 and run["kfac_enabled"] and run["device"] == "cpu"
        assert run["status"] in ("success", "target_not_reached")
    assert "launcher=torchrun" in runs["bert_torchrun"]["command"]
    probe = rec["data"]["collectives"]
    assert probe["ok"] and probe["backend"] == "gloo" and probe["world_size"] == 1
    assert [row[0] for row in _cells(md, "## Smoke recipes")] == list(runs)
