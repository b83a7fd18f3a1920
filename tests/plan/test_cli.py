"""``kfac-bench plan`` end to end: the files it writes, its one-line errors, and the training config it
leaves untouched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kfac_bench.cli import main
from kfac_bench.config.compose import compose_run
from kfac_bench.kfac import FactorReduction, Placement, scan_model
from kfac_bench.plan.costs import Scenario, equal_group_workers, rank_loads
from kfac_bench.plan.recipe import build_meta_model, engine_settings
from tests.harness.util import REPO, run_cli

PAPER_PROFILE = REPO / "profiles" / "paper_v100_resnet50.yaml"
ROW_KEYS = {
    "world_size",
    "placement",
    "grad_worker_fraction",
    "factor_reduction",
    "factor_elements_per_rank",
    "decomposition_cost_per_rank",
    "memory_bytes_per_rank",
    "comm_bytes",
}


@pytest.mark.slow
def test_plan_writes_its_schema_a_plot_and_a_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "digits_plan"
    result = run_cli(
        "plan",
        "+recipe=digits",
        "plan.world_sizes=[4,2]",
        f"plan.out={out}",
        "plan.memory_budget_gb=0.0003",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plan["recipe"] == "digits" and len(plan["layers"]) == 4
    assert {"name", "a_dim", "g_dim"} <= set(plan["layers"][0])
    # Every fraction with equal groups, both placements, both reductions, at each world size.
    assert len(plan["rows"]) == 4 * (len(equal_group_workers(2)) + len(equal_group_workers(4)))
    for row in plan["rows"]:
        assert set(row) >= ROW_KEYS
        assert set(row["factor_elements_per_rank"]) == {"min", "max"}
        assert set(row["decomposition_cost_per_rank"]) == {"max", "min", "ideal", "floor"}
        assert {"factors", "decompositions", "outer_products", "comm_buffers", "total"} <= set(
            row["memory_bytes_per_rank"]
        )
    # The rows are the planner's for the digits model, recomputed here from the composed config.
    cfg = compose_run(["+recipe=digits"])
    model = build_meta_model(cfg.model)
    layers = scan_model(model).layers
    row = next(
        r
        for r in plan["rows"]
        if (r["world_size"], r["grad_workers"], r["placement"], r["factor_reduction"])
        == (4, 2, "lpt", "reduce")
    )
    loads = rank_loads(
        layers, engine_settings(model), Scenario(4, 2, Placement.LPT, FactorReduction.REDUCE)
    )
    assert row["memory_bytes_per_rank"]["total"]["max"] == max(loads.total_memory())
    recs = {r["world_size"]: r for r in plan["recommendations"]}
    assert set(recs) == {2, 4}
    for rec in recs.values():
        if rec["row"] is not None:
            chosen = plan["rows"][rec["row"]]
            assert chosen["memory_bytes_per_rank"]["total"]["max"] <= 0.0003 * 2**30
    assert "recommended under 0.0003 GiB per GPU" in result.stdout
    assert "4 GPUs (ideal" in result.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["+recipe=nope"], "unknown recipe 'nope'; valid names: "),
        (["+recipe=digits", "plan.world_sizes=[]"], "plan.world_sizes is empty"),
        (
            ["+recipe=digits", "plan.world_sizes=[4]", "plan.fractions=[0.75]"],
            "gives 3 gradient workers per layer, which does not divide the world size 4",
        ),
        (["+recipe=digits", "plan.memory_budget_gb=0"], "plan.memory_budget_gb=0.0 must be > 0"),
        (["+recipe=digits", "plan.memory_budget_gb=-2"], "must be > 0"),
        (["+recipe=digits", "plan.worldsizes=[8]"], "unknown key plan.worldsizes"),
        (["+recipe=digits", "plan.world_sizes=[0]"], "must be >= 1"),
        (["+recipe=digits", "kfac.bogus=1"], "unknown config key 'kfac.bogus'"),
        (["+recipe=resnet50_imagenet_sgd"], "trains without K-FAC"),
        (
            ["+recipe=digits", "kfac.factor_batch_fraction=0"],
            "invalid value kfac.factor_batch_fraction=0",
        ),
        (
            ["+recipe=digits", "plan.profile_file=nope.yaml"],
            "plan.profile_file=nope.yaml: no such file",
        ),
        (
            ["+recipe=digits", "plan.profile=true", "plan.profile_file=x.yaml"],
            "plan.profile=true and plan.profile_file both",
        ),
        (["+recipe=digits", "plan.dataset_size=0"], "plan.dataset_size=0 must be >= 1"),
        (
            ["+recipe=digits", f"plan.profile_file={PAPER_PROFILE}", "plan.baseline=digits"],
            "plan.baseline=digits trains with K-FAC: name a first-order recipe, e.g. digits_sgd",
        ),
        (
            ["+recipe=digits_smoke", f"plan.profile_file={PAPER_PROFILE}"],
            "no baseline recipe 'digits_sgd_smoke' for 'digits_smoke': name one with plan.baseline=",
        ),
        (
            ["+recipe=digits", f"plan.profile_file={PAPER_PROFILE}"],
            "was measured on model 'resnet50', the recipe 'digits' plans 'small_cnn'",
        ),
    ],
)
def test_bad_input_gives_one_line_and_status_2(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status = main(["plan", f"plan.out={tmp_path}", *args])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfac-bench: error: ") and expected in lines[0]
    assert not (tmp_path / "plan.json").exists()


def test_plan_keys_stay_out_of_the_training_config() -> None:
    assert "plan" not in compose_run([])
    assert "plan" not in compose_run(["+recipe=resnet50_imagenet"])


@pytest.mark.parametrize("under_a_file", [False, True])
def test_an_output_that_cannot_be_a_folder_stops_before_the_work(
    under_a_file: bool,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """plan.out a file, or a folder below a file: one line and status 2 before the recipe is loaded."""
    a_file = tmp_path / "plan.txt"
    a_file.write_text("kept\n")
    out = a_file / "sub" if under_a_file else a_file

    def loaded(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the recipe was loaded before plan.out was checked")

    monkeypatch.setattr("kfac_bench.plan.recipe.load_recipe", loaded)
    status = main(["plan", "+recipe=digits", f"plan.out={out}"])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kfac-bench: error: plan.out={out} ")
    assert "give a folder" in lines[0]
    assert a_file.read_text() == "kept\n"


def test_the_default_output_is_a_fresh_folder_under_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without plan.out the files go to runs/plan/<recipe>_<date>_<time>_<uid>/ (runs/ is git-ignored);
    without a profile the time to solution is an empty list and the reason."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "+recipe=digits", "plan.world_sizes=[2]"]) == 0
    (folder,) = (tmp_path / "runs" / "plan").iterdir()
    # <recipe>_<date>_<time>_<6 random hex digits>, as every command's default output folder: two plans
    # in one second get two folders.
    assert re.fullmatch(r"digits_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}", folder.name)
    assert sorted(p.name for p in folder.iterdir()) == ["plan.json", "plan.png"]
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["time_to_solution"] == []
    assert "plan.profile_file" in plan["time_to_solution_model"]["reason"]
    out = capsys.readouterr().out
    assert (
        "time to solution: not projected" in out
        and f"wrote {Path('runs', 'plan', folder.name)}" in out
    )
    gitignore = (REPO / ".gitignore").read_text().splitlines()
    assert "runs/" in gitignore


@pytest.mark.slow
def test_plan_with_the_paper_profile_prints_the_time_to_solution(tmp_path: Path) -> None:
    """The documented command: the table, time_to_solution in plan.json, and the Fig.-8-style plot."""
    out = tmp_path / "paper"
    result = run_cli(
        "plan",
        "+recipe=resnet50_imagenet",
        "kfac.reference_world_size=320",
        f"plan.profile_file={REPO / 'profiles' / 'paper_v100_resnet50.yaml'}",
        "plan.world_sizes=[16,64,256]",
        f"plan.out={out}",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (out / "time_to_solution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = json.loads((out / "plan.json").read_text())
    entries = plan["time_to_solution"]
    assert [(e["world_size"], e["arm"]) for e in entries] == [
        (n, arm) for n in (16, 64, 256) for arm in ("sgd", "comm_opt", "mem_opt", "hybrid_opt")
    ]
    assert all(e["minutes"] > 0 for e in entries)
    table = result.stdout[result.stdout.index("time to solution") :]
    at_64 = next(line for line in table.splitlines() if line.split()[:1] == ["64"])
    k = entries[5]
    assert k["arm"] == "comm_opt" and "50/500" in at_64
    assert f"{k['minutes']:.0f} ({k['minutes_low']:.0f}–{k['minutes_high']:.0f})" in at_64
