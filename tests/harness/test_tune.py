"""``kfac-bench tune``: both arms swept on one grid and budget, the censored objective, and the tuned
recipe pair written into a config dir where it composes and carries its tuning record."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kfac_bench.commands import train as train_command
from kfac_bench.commands import tune
from kfac_bench.config.compose import compose_run
from kfac_bench.errors import UserError
from tests.recipes.test_documented_sweeps import TUNED_SWEEPS, check_baselines, miniature


def _summary(lr: float, seed: int, **outcome: Any) -> dict[str, Any]:
    config = {"optimizer": {"lr": lr}, "kfac": {"damping": 0.003}, "train": {"seed": seed}}
    return {"config": config, "kfac_enabled": False, "wall_time_s": 10.0, **outcome}


def test_a_missed_run_counts_its_whole_training_time_and_a_diverged_one_never() -> None:
    reached = _summary(
        0.1, 0, status="success", reached_target=True, time_to_target_s=4.0, epochs_to_target=2
    )
    missed = _summary(0.1, 1, status="target_not_reached", reached_target=False)
    diverged = _summary(0.8, 0, status="diverged", reached_target=False, wall_time_s=0.5)
    assert tune.censored_time(reached) == 4.0
    assert tune.censored_time(missed) == 10.0  # at least its 10 s, not dropped
    assert math.isinf(tune.censored_time(diverged))  # stopping early is no speed
    ranked = tune.score([reached, missed, diverged], "sgd")
    assert [(p.lr, p.reached, len(p.times)) for p in ranked] == [(0.1, 1, 2), (0.8, 0, 1)]
    assert ranked[0].objective == 7.0 and ranked[0].damping is None


def test_tune_refuses_a_first_order_recipe_in_one_line() -> None:
    with pytest.raises(UserError, match="recipe digits_sgd runs no K-FAC"):
        tune.main(["+recipe=digits_sgd", "--out", "unused"])


@pytest.mark.slow
def test_tune_sweeps_both_arms_and_writes_tuned_recipes_that_compose(tmp_path: Path) -> None:
    out, conf = tmp_path / "tune", tmp_path / "conf"
    args = ["+recipe=digits", "--lrs", "0.1", "0.4", "--dampings", "0.003", "0.01", "--seeds", "0"]
    tiny = ["train.limit_train_batches=2", "train.limit_eval_batches=1", "model.channels=4"]
    tiny += ["model.hidden=8", "train.tensorboard=false", "train.targets.top1=0.2"]
    status = tune.main(
        [*args, "--epochs", "2", "--out", str(out), "--out-config", str(conf), *tiny]
    )
    assert status == 0
    rows = list(csv.DictReader((out / "tune.csv").open()))
    assert sorted((r["arm"], r["lr"], r["damping"]) for r in rows) == [
        ("kfac", "0.1", "0.003"),
        ("kfac", "0.1", "0.01"),
        ("kfac", "0.4", "0.003"),
        ("kfac", "0.4", "0.01"),
        ("sgd", "0.1", ""),
        ("sgd", "0.4", ""),
    ]
    best = {r["arm"]: r for r in rows if r["best"] == "*"}
    assert (out / "tune.md").read_text().count("| * |") == 2 and (
        out / "tune.png"
    ).stat().st_size > 1000
    for summary in out.glob("*/*/summary.json"):
        s = json.loads(summary.read_text())
        assert s["config"]["train"]["campaign"] == str(out)
        assert s["config"]["train"]["epochs"] == 2 and s["config"]["train"]["stop_at_target"]
    for recipe, arm in (("digits_sgd_tuned", "sgd"), ("digits_tuned", "kfac")):
        cfg = compose_run([f"+recipe={recipe}"], config_dirs=[conf])
        assert cfg.name == recipe and cfg.optimizer.lr == float(best[arm]["lr"])
        assert cfg.tuning.arm == arm and str(out) in cfg.tuning.source
        assert cfg.tuning["values"].optimizer.lr == cfg.optimizer.lr
        assert cfg.kfac.enabled == (arm == "kfac")
        if arm == "kfac":
            assert cfg.kfac.damping == float(best[arm]["damping"])
            assert cfg.tuning["values"].kfac.damping == cfg.kfac.damping
        # The rest is the recipe's: the tuned recipe is a delta over it.
        assert cfg.train.epochs == 30 and list(cfg.lr_schedule.milestones) == [25]
    # The documented sweep over the tuned pair runs against this config dir, each baseline tuned.
    assert TUNED_SWEEPS
    for n, (where, sweep_args) in enumerate(TUNED_SWEEPS):
        sweep = tmp_path / f"sweep{n}"
        assert train_command.main(miniature(sweep_args, sweep, tmp_path / "data", conf)) == 0
        check_baselines(where, sweep)
