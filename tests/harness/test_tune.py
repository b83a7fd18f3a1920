"""``kfac-bench tune``: both arms swept on one grid and budget, the censored objective, and the tuned
recipe pair written into a config dir where it composes and carries its tuning record."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from kfac_bench.cli import main as cli_main
from kfac_bench.commands import train as train_command
from kfac_bench.commands import tune
from kfac_bench.commands.tuning import files as tune_files
from kfac_bench.commands.tuning.rank import points_of, rank
from kfac_bench.commands.tuning.rank import table as tune_rank_table
from kfac_bench.compare.fairness import run_flags
from kfac_bench.config.compose import compose_run
from kfac_bench.errors import UserError
from tests.recipes.test_documented_sweeps import TUNED_SWEEPS, check_baselines, miniature


def _summary(lr: float, seed: int, **outcome: Any) -> dict[str, Any]:
    config = {"optimizer": {"lr": lr}, "kfac": {"damping": 0.003}, "train": {"seed": seed}}
    return {"config": config, "kfac_enabled": False, "wall_time_s": 10.0, **outcome}


def _reached(lr: float, seed: int, epochs: float, seconds: float) -> dict[str, Any]:
    return _summary(
        lr,
        seed,
        status="success",
        reached_target=True,
        time_to_target_s=seconds,
        epochs_to_target=epochs,
    )


def test_a_missed_run_counts_its_whole_training_time_and_a_diverged_one_never() -> None:
    reached = _reached(0.1, 0, 2, 4.0)
    missed = _summary(0.1, 1, status="target_not_reached", reached_target=False)
    diverged = _summary(0.8, 0, status="diverged", reached_target=False, wall_time_s=0.5)
    assert tune.censored_time(reached) == 4.0
    assert tune.censored_time(missed) == 10.0  # at least its 10 s, not dropped
    assert math.isinf(tune.censored_time(diverged))  # stopping early is no speed
    ranked = tune.score([reached, missed, diverged], "sgd")
    assert [(p.lr, p.reached, len(p.summaries)) for p in ranked] == [(0.1, 1, 2), (0.8, 0, 1)]
    assert ranked[0].median_time == 7.0 and ranked[0].damping is None


def test_epochs_rank_first_and_a_faster_clock_does_not_beat_fewer_epochs() -> None:
    # LR 0.4 is faster on the clock in every seed but needs more epochs: 0.1 wins.
    runs = [_reached(0.1, s, 9, 5.0 + s) for s in range(3)]
    runs += [_reached(0.4, s, 10, 2.0 + s) for s in range(3)]
    # A point that missed in one seed ranks below both, however fast its other seeds.
    runs += [_reached(0.2, s, 5, 1.0) for s in range(2)]
    runs.append(_summary(0.2, 2, status="target_not_reached", reached_target=False))
    ranking = rank(points_of(runs, "sgd"))
    assert [p.lr for p in ranking.points] == [0.1, 0.4, 0.2]
    assert not ranking.tied and "fewest epochs" in ranking.reason


def test_the_clock_breaks_a_tie_only_where_its_interval_separates() -> None:
    # Tied on epochs. LR 0.4 takes half the time of 0.1 in every seed: the interval separates, 0.4 wins.
    runs = [_reached(0.1, s, 9, 10.0 + s) for s in range(3)]
    runs += [_reached(0.4, s, 9, 5.0 + s / 2) for s in range(3)]
    clear = rank(points_of(runs, "sgd"))
    assert [p.lr for p in clear.points] == [0.4, 0.1] and not clear.tied
    assert "below theirs with 95 % confidence" in clear.reason
    # Tied on epochs, clocks that load noise moved both ways (2.25 s to 6.53 s): a tie, shown, and the
    # tie goes to the smaller LR whatever the medians say.
    noisy = [_reached(0.1, s, 9, t) for s, t in enumerate((6.53, 2.3, 4.0))]
    noisy += [_reached(0.4, s, 9, t) for s, t in enumerate((2.25, 5.9, 3.1))]
    tie = rank(points_of(noisy, "sgd"))
    assert [p.lr for p in tie.points] == [0.1, 0.4] and {p.lr for p in tie.tied} == {0.1, 0.4}
    assert "tied with 1 other point(s)" in tie.reason
    table, rows = tune_rank_table({"sgd": tie}, "budget")
    assert [r[-1] for r in rows[1:]] == ["1 (best)", "2 (tied with best)"]
    assert "2.3 [2.3-6.53]" not in table and "4 [2.3-6.53]" in table  # median [min-max] shown


def test_an_arm_where_nothing_reached_has_no_best() -> None:
    runs = [_summary(lr, 0, status="target_not_reached", reached_target=False) for lr in (0.1, 0.2)]
    ranking = rank(points_of(runs, "sgd"))
    assert not ranking.reached and "no point reached" in ranking.reason


def test_the_two_arms_jobs_interleave_in_time() -> None:
    sgd, kfac = tune.Arm("sgd", "digits_sgd", False), tune.Arm("kfac", "digits", True)
    jobs = tune._jobs([sgd, kfac], [0.1, 0.2], [0.001, 0.003, 0.01], [0, 1])
    assert len(jobs) == 4 + 12 and len(set(jobs)) == 16
    order = ["s" if j.arm is sgd else "k" for j in jobs]
    # The 4 SGD runs are spread over the whole tune: one in each quarter, never in a block.
    quarters = [order[i * 4 : (i + 1) * 4].count("s") for i in range(4)]
    assert quarters == [1, 1, 1, 1]
    # Seed by seed: every seed-0 run of an arm comes before its seed-1 runs.
    for arm in (sgd, kfac):
        seeds = [j.seed for j in jobs if j.arm is arm]
        assert seeds == sorted(seeds)


def test_seeds_given_twice_run_once(capsys: pytest.CaptureFixture[str]) -> None:
    ns = tune._parse(["+recipe=digits", "--seeds", "0", "0", "1"])
    assert ns.seeds == [0, 1] and "seed(s) 0 given twice" in capsys.readouterr().out


def test_tune_refuses_a_first_order_recipe_in_one_line() -> None:
    with pytest.raises(UserError, match="recipe digits_sgd runs no K-FAC"):
        tune.main(["+recipe=digits_sgd", "--out", "unused"])


class FakeTrain:
    """``kfac-bench train`` for one job, without training: writes the run's summary.json (the composed
    config, the outcome ``outcome(arm, lr, damping, seed)`` gives) into its hydra.run.dir. ``stop_after``
    runs: the next one is "preempted" (exit 75, no summary), as a SIGTERM mid-run makes it."""

    def __init__(self, outcome: Any, stop_after: int | None = None) -> None:
        self.outcome, self.stop_after, self.calls = outcome, stop_after, []

    def __call__(self, args: list[str]) -> int:
        self.calls.append(args)
        if self.stop_after is not None and len(self.calls) > self.stop_after:
            return 75
        kv = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
        dirs = [a.split("=", 1)[1] for a in args if a.startswith("--config-dir=")]
        keep = [a for a in args if not a.startswith(("-", "hydra.", "train.campaign"))]
        config = json.loads(
            json.dumps(
                OmegaConf.to_container(compose_run(keep, config_dirs=dirs), resolve=True),
                default=str,
            )
        )
        kfac = bool(config["kfac"]["enabled"])
        lr, seed = float(kv["optimizer.lr"]), int(kv["train.seed"])
        damping = float(kv["kfac.damping"]) if kfac else None
        epochs = self.outcome("kfac" if kfac else "sgd", lr, damping, seed)
        reached = epochs is not None
        summary = {
            "name": config["name"],
            "status": "success" if reached else "target_not_reached",
            "reached_target": reached,
            "kfac_enabled": kfac,
            "epochs_to_target": epochs,
            "time_to_target_s": 0.5 * epochs if reached else None,
            "wall_time_s": 0.5 * (epochs or 30),
            "config": config,
        }
        run_dir = Path(kv["hydra.run.dir"].strip("'"))
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return 0


def _fake(
    monkeypatch: pytest.MonkeyPatch, outcome: Any, stop_after: int | None = None
) -> FakeTrain:
    fake = FakeTrain(outcome, stop_after)
    monkeypatch.setattr(train_command, "main", fake)
    return fake


def _by_lr(arm: str, lr: float, damping: float | None, seed: int) -> float | None:
    """SGD reaches fastest at LR 0.2, K-FAC at 0.4 with damping 0.01 (epochs to target)."""
    best = {"sgd": (0.2, None), "kfac": (0.4, 0.01)}[arm]
    return 5.0 if (lr, damping) == best else 8.0


GRID = ["--lrs", "0.2", "0.4", "--dampings", "0.003", "0.01", "--seeds", "0", "1"]
GRID += ["--baseline", "digits_sgd"]


def test_the_tuned_pair_holds_what_the_winning_runs_ran_on_a_smoke_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _fake(monkeypatch, _by_lr)
    out, conf = tmp_path / "tune", tmp_path / "conf"
    assert (
        tune.main(["+recipe=digits_smoke", *GRID, "--out", str(out), "--out-config", str(conf)])
        == 0
    )
    assert len(fake.calls) == 2 * 2 + 2 * 4
    for recipe, arm, lr in (
        ("digits_sgd_tuned", "sgd", 0.2),
        ("digits_smoke_tuned", "kfac", 0.4),
    ):
        cfg = compose_run([f"+recipe={recipe}"], config_dirs=[conf])
        assert cfg.optimizer.lr == lr and cfg.tuning.arm == arm
        record = OmegaConf.to_container(cfg.tuning["values"], resolve=True)
        # Exactly the smoke twin's values that ran, schedule included (digits' record says [25]).
        ran = compose_run([f"+recipe={recipe.removesuffix('_tuned')}", f"optimizer.lr={lr}"])
        assert record["lr_schedule"] == OmegaConf.to_container(ran.lr_schedule, resolve=True)
        if arm == "kfac":
            assert record["lr_schedule"]["milestones"] != [25]
        assert record["optimizer"]["lr"] == lr
        # compare reads the tuned pair's runs as at their tuned values: no fairness flag.
        summary = {
            "kfac_enabled": arm == "kfac",
            "config": OmegaConf.to_container(cfg, resolve=True),
        }
        assert run_flags(json.loads(json.dumps(summary, default=str)), "arm") == []
    assert compose_run(["+recipe=digits_smoke_tuned"], config_dirs=[conf]).kfac.damping == 0.01
    printed = capsys.readouterr().out
    # The follow-up: fresh seeds (not the tuning's 0 1), seed first so a seed's arms run back to back.
    follow = next(line.strip() for line in printed.splitlines() if "train -m" in line)
    assert follow.startswith("kfac-bench train -m train.seed=2,3,4 +recipe=digits_sgd_tuned,")
    assert follow.endswith(f"--config-dir {conf}")
    assert "(best)" in (out / "tune.md").read_text()
    assert (out / "tune.png").read_bytes().startswith(b"\x89PNG")


def test_by_default_the_pair_goes_into_the_tunes_folder_and_a_rerun_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake(monkeypatch, _by_lr)
    out = tmp_path / "tune"
    assert tune.main(["+recipe=digits_smoke", *GRID, "--out", str(out)]) == 0
    assert (out / "config" / "recipe" / "digits_smoke_tuned.yaml").is_file()
    before = (out / "config" / "recipe" / "digits_smoke_tuned.yaml").read_text()
    assert tune.main(["+recipe=digits_smoke", *GRID, "--out", str(out)]) == 0
    assert len(fake.calls) == 12  # every run finished the first time: none runs again
    assert (out / "config" / "recipe" / "digits_smoke_tuned.yaml").read_text() == before


def test_an_arm_that_never_reached_gets_no_tuned_recipe_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake(monkeypatch, lambda arm, *_: None if arm == "kfac" else 5.0)
    out, conf = tmp_path / "tune", tmp_path / "conf"
    status = tune.main(
        ["+recipe=digits_smoke", *GRID, "--out", str(out), "--out-config", str(conf)]
    )
    assert status == tune.EXIT_NOT_REACHED
    assert not list((conf / "recipe").glob("*.yaml"))  # neither recipe: the pair is a unit
    line = [x for x in capsys.readouterr().out.splitlines() if "no tuned recipe" in x]
    assert len(line) == 1 and "widen --lrs (tried 0.2 to 0.4) or --dampings" in line[0]
    assert (out / "tune.md").is_file()  # what was tried is still shown


def test_a_stopped_tune_continues_from_its_finished_runs_and_never_mixes_grids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, conf = tmp_path / "tune", tmp_path / "conf"
    args = ["+recipe=digits_smoke", *GRID, "--out", str(out), "--out-config", str(conf)]
    stopped = _fake(monkeypatch, _by_lr, stop_after=5)
    assert tune.main(args) == 75  # the sixth run was preempted: no other started
    assert len(stopped.calls) == 6 and not (conf / "recipe" / "digits_smoke_tuned.yaml").exists()
    again = _fake(monkeypatch, _by_lr)
    assert tune.main(args) == 0
    assert len(again.calls) == 12 - 5  # the 5 finished runs are kept, the preempted one runs again
    assert again.calls[0] == stopped.calls[5]  # in the same run directory: it resumes there
    with pytest.raises(UserError, match="holds a tune of another grid"):
        tune.main([*args, "--epochs", "3"])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(UserError, match=r"already holds 1 entry \(x\).*stopped tune"):
        tune.main([*args[:-4], "--out", str(tmp_path / "other")])


def test_output_mistakes_are_one_line_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake(monkeypatch, _by_lr)
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    base = ["+recipe=digits_smoke", *GRID]
    with pytest.raises(UserError, match=r"--out .* is a file"):
        tune.main([*base, "--out", str(a_file)])
    with pytest.raises(UserError, match=r"--out-config .* is a file"):
        tune.main([*base, "--out", str(tmp_path / "t1"), "--out-config", str(a_file)])
    # A link planted where recipe/ goes is refused, its target untouched.
    (tmp_path / "victim").mkdir()
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "recipe").symlink_to(tmp_path / "victim")
    with pytest.raises(UserError, match="symbolic link"):
        tune.main([*base, "--out", str(tmp_path / "t2"), "--out-config", str(tmp_path / "conf")])
    assert (
        not fake.calls and a_file.read_text() == "mine" and not any((tmp_path / "victim").iterdir())
    )


def test_two_tunes_into_one_config_dir_are_refused(tmp_path: Path) -> None:
    first = tune_files.config_lock(tmp_path / "conf")
    first.__enter__()
    with (
        pytest.raises(UserError, match="another tune is writing"),
        tune_files.config_lock(tmp_path / "conf"),
    ):
        pass
    first.__exit__(None, None, None)
    with tune_files.config_lock(tmp_path / "conf"):  # released with the first tune
        pass


def test_a_second_tune_into_a_busy_config_dir_is_refused_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake(monkeypatch, _by_lr)
    conf = tmp_path / "conf"
    args = ["+recipe=digits_smoke", *GRID, "--out-config", str(conf)]
    busy = "another tune is writing its tuned recipes there"
    # The first tune, still running, holds the config dir.
    with tune_files.config_lock(conf), pytest.raises(UserError, match=busy):
        tune.main([*args, "--out", str(tmp_path / "second")])
    assert not fake.calls
    assert tune.main([*args, "--out", str(tmp_path / "third")]) == 0  # once the first has ended


def test_the_pair_is_written_whole_or_not_at_all_and_never_through_a_link(tmp_path: Path) -> None:
    recipes = tmp_path / "recipe"
    recipes.mkdir()
    tune_files.write_pair(recipes, {"a_tuned": "a: 1\n", "b_tuned": "b: 1\n"})
    victim = tmp_path / "victim.yaml"
    victim.write_text("precious")
    (recipes / "b_tuned.yaml").unlink()
    (recipes / "b_tuned.yaml").symlink_to(victim)
    with pytest.raises(UserError, match="symbolic link"):
        tune_files.write_pair(recipes, {"a_tuned": "a: 2\n", "b_tuned": "b: 2\n"})
    # Neither file of the second pair is in place, and no temporary file is left behind.
    assert (recipes / "a_tuned.yaml").read_text() == "a: 1\n" and victim.read_text() == "precious"
    assert sorted(p.name for p in recipes.iterdir()) == ["a_tuned.yaml", "b_tuned.yaml"]


def test_a_failed_rename_puts_the_earlier_pair_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    recipes = tmp_path / "recipe"
    recipes.mkdir()
    tune_files.write_pair(recipes, {"a_tuned": "a: 1\n", "b_tuned": "b: 1\n"})
    real, calls = os.replace, []

    def second_fails(src: Any, dst: Any) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(tune_files.os, "replace", second_fails)
    with pytest.raises(OSError):
        tune_files.write_pair(recipes, {"a_tuned": "a: 2\n", "b_tuned": "b: 2\n"})
    monkeypatch.setattr(tune_files.os, "replace", real)
    assert (recipes / "a_tuned.yaml").read_text() == "a: 1\n"  # the first rename undone
    assert (recipes / "b_tuned.yaml").read_text() == "b: 1\n"
    assert sorted(p.name for p in recipes.iterdir()) == ["a_tuned.yaml", "b_tuned.yaml"]
    # A first pair that fails half-way leaves no recipe at all.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    calls.clear()
    monkeypatch.setattr(tune_files.os, "replace", second_fails)
    with pytest.raises(OSError):
        tune_files.write_pair(fresh, {"a_tuned": "a: 2\n", "b_tuned": "b: 2\n"})
    assert not list(fresh.iterdir())


def test_tune_out_a_file_is_one_line_from_the_cli(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert cli_main(["tune", "+recipe=digits_smoke", "--out", str(a_file)]) == 2


@pytest.mark.slow
def test_tune_sweeps_both_arms_and_writes_tuned_recipes_that_compose(tmp_path: Path) -> None:
    out, conf = tmp_path / "tune", tmp_path / "conf"
    args = ["+recipe=digits", "--lrs", "0.1", "0.4", "--dampings", "0.003", "0.01", "--seeds", "0"]
    tiny = ["train.limit_train_batches=2", "train.limit_eval_batches=1", "model.channels=4"]
    tiny += ["model.hidden=8", "train.tensorboard=false", "train.targets.top1=0.05"]
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
    best = {r["arm"]: r for r in rows if "(best)" in r["rank"]}
    assert (out / "tune.md").read_text().count("(best)") == 2 and (
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


@pytest.mark.slow
def test_sigterm_stops_tune_after_the_current_run_and_the_same_command_continues(
    tmp_path: Path,
) -> None:
    import signal
    import time

    from tests.harness.fault_util import fault, run, start
    from tests.harness.util import TINY_SETTINGS

    marker = tmp_path / "held"
    out = tmp_path / "tune"
    args = ["tune", "+recipe=digits_smoke", "--baseline", "digits_sgd", "--lrs", "0.1"]
    args += ["--dampings", "0.003", "--seeds", "0", "1", "--epochs", "1", "--out", str(out)]
    args += ["--out-config", str(tmp_path / "conf"), *TINY_SETTINGS, "train.targets.top1=0.05"]
    # The first run holds at its second step until a signal comes from outside.
    proc = start(*args, *fault(marker, 2, "hold"), cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-2000:]
    assert "Run the same command to continue" in stdout
    started = sorted(p.relative_to(out).as_posix() for p in out.glob("*/*") if p.is_dir())
    assert started == ["sgd/lr0.1_seed0"]  # the current run checkpointed; no other started
    assert (out / "sgd" / "lr0.1_seed0" / "checkpoints").is_dir()
    again = run(*args, *fault(marker, 2, "hold"), cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "continuing" in again.stdout and "0 of 4 runs finished" in again.stdout
    assert "resumed at step" in again.stdout  # the preempted run resumed from its checkpoint
    assert len(list(out.glob("*/*/summary.json"))) == 4
    assert (tmp_path / "conf" / "recipe" / "digits_smoke_tuned.yaml").is_file()
