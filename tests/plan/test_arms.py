"""Each arm its own length, rows a recipe cannot use left out with their reason, the names and meanings the
output gives, and a plan folder that is never overwritten (``kfac-bench plan`` in this process, on digits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kfac_bench.cli import main

PROFILE = """\
device: a test bench
model: small_cnn
precision: fp32
measured_at: {world_size: 1, batch_size: 256, grad_workers: 1, placement: lpt}
baseline_step_s: {value: 0.004, source: made up}
stages_s: {factor: 0.001, decomposition: 0.002, precondition: 5e-4, kl_clip: 1e-4}
"""


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "digits.yaml"
    path.write_text(PROFILE)
    return path


def plan(
    tmp_path: Path, profile: Path, *extra: str, out: str = "out"
) -> tuple[int, dict, str, str]:
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(
            [
                "plan",
                "+recipe=digits",
                f"plan.profile_file={profile}",
                f"plan.out={tmp_path / out}",
                "plan.fractions=[comm_opt]",
                *extra,
            ]
        )
    path = tmp_path / out / "plan.json"
    data = json.loads(path.read_text()) if status == 0 else {}
    return status, data, stdout.getvalue(), stderr.getvalue()


def arm(data: dict, name: str, n: int) -> dict:
    return next(e for e in data["time_to_solution"] if e["arm"] == name and e["world_size"] == n)


def test_each_arm_keeps_its_own_length_and_both_are_printed(tmp_path: Path, profile: Path) -> None:
    status, data, out, _ = plan(tmp_path, profile, "plan.world_sizes=[1]")
    assert status == 0
    sgd, kfac = arm(data, "sgd", 1), arm(data, "comm_opt", 1)
    info = data["time_to_solution_model"]
    assert (sgd["epochs"], kfac["epochs"]) == (info["baseline"]["epochs"], info["kfac"]["epochs"])
    assert f"{sgd['epochs']} epochs; K-FAC" in out and f"{kfac['epochs']} epochs" in out
    # plan.kfac_epochs changes the K-FAC arm only; plan.baseline_max_steps the baseline only.
    status, longer, out, _ = plan(
        tmp_path,
        profile,
        "plan.world_sizes=[1]",
        "plan.kfac_epochs=3",
        "plan.baseline_max_steps=7",
        out="o2",
    )
    assert status == 0
    k2, s2 = arm(longer, "comm_opt", 1), arm(longer, "sgd", 1)
    assert k2["epochs"] == 3 and k2["steps"] == 3 * kfac["steps_per_epoch"]
    assert s2["epochs"] == sgd["epochs"] and s2["steps"] == 7 and s2["max_steps"] == 7
    assert "3 epochs" in out and "or 7 steps, whichever ends first" in out


@pytest.mark.parametrize("key", ["train.epochs=45", "+train.max_steps=10"])
def test_a_length_for_both_arms_at_once_is_refused(key: str, tmp_path: Path, profile: Path) -> None:
    status, _, _, err = plan(tmp_path, profile, key)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1
    assert "would change both arms' length" in lines[0] and "plan.kfac_" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_world_size_the_recipe_cannot_use_leaves_out_its_row_only(
    tmp_path: Path, profile: Path
) -> None:
    """digits fixes a global batch of 256: 3 GPUs cannot split it, 2 and 4 can."""
    status, data, out, _ = plan(tmp_path, profile, "plan.world_sizes=[2,3,4]")
    assert status == 0
    for n in (2, 4):
        assert arm(data, "sgd", n)["minutes"] > 0 and arm(data, "comm_opt", n)["minutes"] > 0
    for name in ("sgd", "comm_opt"):
        e = arm(data, name, 3)
        assert e["minutes"] is None and "not a multiple of world size 3" in e["reason"]
    assert "not projected (sgd at 3, comm_opt at 3" in out


def test_every_projection_has_a_band_printed_and_drawn(tmp_path: Path, profile: Path) -> None:
    status, data, out, _ = plan(tmp_path, profile, "plan.world_sizes=[1,2]")
    assert status == 0
    for e in data["time_to_solution"]:
        if e["minutes"] is not None:
            assert e["minutes_low"] < e["minutes"] < e["minutes_high"]
            # No cluster, no stated uncertainty: the stated default, 10 % either side.
            assert e["minutes_high"] / e["minutes"] == pytest.approx(1.10)
    assert "unstated: 10 % assumed" in out
    e = arm(data, "comm_opt", 2)
    assert f"{e['minutes']:.0f} ({e['minutes_low']:.0f}–{e['minutes_high']:.0f})" in out


def test_titles_name_the_model_and_the_budget_says_what_it_counts(
    tmp_path: Path, profile: Path
) -> None:
    status, data, out, _ = plan(
        tmp_path, profile, "plan.world_sizes=[2]", "plan.memory_budget_gb=1"
    )
    assert status == 0 and data["model"] == "small_cnn"
    assert out.startswith("kfac-bench plan: digits (small_cnn)")
    assert "time to solution of small_cnn" in out
    assert "of K-FAC memory (factors, decompositions and buffers only" in out
    assert "K-FAC's memory only" in data["memory_budget_counts"]


def test_a_profile_of_a_micro_batch_is_refused(tmp_path: Path) -> None:
    """batch_size is examples per rank per step: 16 where a step takes 256 is refused in one line."""
    path = tmp_path / "micro.yaml"
    path.write_text(PROFILE.replace("batch_size: 256", "batch_size: 16"))
    status, _, _, err = plan(tmp_path, path, "plan.world_sizes=[1]")
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1
    assert "measured_at.batch_size=16 at 1 GPUs implies a global batch of 16" in lines[0]
    assert "trains 256 examples per rank per step" in lines[0]


def test_a_plan_never_overwrites_an_earlier_one(tmp_path: Path, profile: Path) -> None:
    status, _, _, _ = plan(tmp_path, profile, "plan.world_sizes=[1]")
    assert status == 0
    before = (tmp_path / "out" / "plan.json").read_bytes()
    status, _, _, err = plan(tmp_path, profile, "plan.world_sizes=[2]")
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1
    assert f"plan.out={tmp_path / 'out'} already holds" in lines[0]
    assert (tmp_path / "out" / "plan.json").read_bytes() == before
    # An empty folder is fine (made beforehand, e.g. by a job script).
    (tmp_path / "empty").mkdir()
    assert plan(tmp_path, profile, "plan.world_sizes=[1]", out="empty")[0] == 0
