"""``kfac-bench compare`` by arm on hand-made run directories with known numbers: labels, the default
baseline, seeds grouped into median and spread, the verdict line, and runs cut off by a crash.

The runs are written in the real on-disk format by the harness's own writers (``write_summary``,
``JsonlSink``, ``record_config``); every expected value is computed here from the numbers the test chose.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import scipy.stats
import yaml

from kfac_bench.compare.report import Comparison, find_runs, render, table_rows
from kfac_bench.config.compose import compose_run
from kfac_bench.errors import UserError
from kfac_bench.launcher.rundir import record_config
from kfac_bench.metrics.sinks import JsonlSink
from kfac_bench.metrics.summary import arm_label, write_summary
from tests.harness.util import run_cli

TARGET = 0.9
STEPS_PER_EPOCH = 5


def make_run(
    path: Path,
    *,
    seed: int,
    curve: list[float],
    epoch_s: float,
    step_s: float,
    kfac: str | None = None,
    optimizer: str = "sgd",
    lr: float = 0.1,
    config: dict[str, Any] | None = None,
) -> Path:
    """A finished run: one evaluation per epoch (top1 ``curve[i]`` after epoch i + 1, at ``epoch_s``
    seconds per epoch), and its summary as ``kfac_bench.metrics.summary.run_summary`` lays it out."""
    path.mkdir(parents=True)
    sink = JsonlSink(path / "eval.jsonl")
    records = []
    for i, top1 in enumerate(curve):
        t = round((i + 1) * epoch_s, 6)
        record = {
            "step": (i + 1) * STEPS_PER_EPOCH,
            "epoch": float(i + 1),
            "samples": (i + 1) * STEPS_PER_EPOCH * 256,
            "wall_time_s": t,
            "train_time_s": t,
            "metrics": {"top1": top1, "loss": 1.0 - top1},
        }
        sink.write(record)
        records.append(record)
    hit = next((r for r in records if r["metrics"]["top1"] >= TARGET), None)
    config = config or {
        "name": "hand",
        "optimizer": {"name": optimizer, "lr": lr, "momentum": 0.9},
        "kfac": {"enabled": kfac is not None, "grad_worker_fraction": kfac or "comm_opt"},
        "train": {"seed": seed, "targets": {"top1": TARGET}},
        "task": {"target_metric": "top1"},
        # Each arm at the values tuned for it (compare's fairness checks read this record).
        "tuning": {
            "arm": "kfac" if kfac else optimizer,
            "source": "a hand-made grid",
            "values": {"optimizer": {"lr": lr}},
        },
    }
    steps = len(curve) * STEPS_PER_EPOCH
    write_summary(
        path,
        {
            "name": "hand",
            "status": "success" if hit else "target_not_reached",
            "target_metric": "top1",
            "targets": {"top1": TARGET},
            "target_value": TARGET,
            "higher_is_better": True,
            "reached_target": hit is not None,
            "time_to_target_s": hit["wall_time_s"] if hit else None,
            "epochs_to_target": hit["epoch"] if hit else None,
            "best_metric": max(curve),
            "final_metrics": records[-1]["metrics"],
            "mean_step_time_s": step_s,
            "samples_per_s": 256 / step_s,
            "steps": steps,
            "epochs": float(len(curve)),
            "wall_time_s": round(len(curve) * epoch_s, 6),
            "kfac_enabled": kfac is not None,
            # K-FAC's stages take 40 % of each step.
            "kfac_stage_times_s": {"factor": 0.4 * step_s * steps} if kfac else {},
            "kfac_time_fraction": 0.4 if kfac else None,
            "config": config,
        },
    )
    return path


def curve(reach_at: int | None, epochs: int = 30, dip_at: int | None = None) -> list[float]:
    """top1 per epoch: 0.5 until epoch ``reach_at`` (1-based), 0.95 from there, 0.85 at ``dip_at``."""
    values = [0.95 if reach_at is not None and e >= reach_at else 0.5 for e in range(1, epochs + 1)]
    if dip_at is not None:
        values[dip_at - 1] = 0.85
    return values


def arms(
    root: Path, sgd: list[tuple[int | None, float]], kfac: list[tuple[int | None, float]]
) -> list[Path]:
    """K-FAC runs first, then SGD (so the default baseline is not simply the first given): one run per
    seed, ``(epoch reaching the target or None, seconds per epoch)``; steps cost 20 ms (SGD), 36 ms."""
    dirs = []
    for seed, (reach, epoch_s) in enumerate(kfac):
        dirs.append(
            make_run(
                root / f"kfac{seed}",
                seed=seed,
                curve=curve(reach),
                epoch_s=epoch_s,
                step_s=0.036,
                kfac="comm_opt",
            )
        )
    for seed, (reach, epoch_s) in enumerate(sgd):
        dirs.append(
            make_run(
                root / f"sgd{seed}", seed=seed, curve=curve(reach), epoch_s=epoch_s, step_s=0.020
            )
        )
    return dirs


def _summary(config: dict[str, Any], enabled: bool | None = None) -> dict[str, Any]:
    return {"kfac_enabled": enabled, "config": config}


def test_arm_labels_name_the_optimizer_and_the_kaisa_strategy() -> None:
    sgd = {"optimizer": {"name": "sgd"}, "kfac": {"enabled": False}}
    assert arm_label(_summary(sgd, False)) == "SGD"
    on = {
        "optimizer": {"name": "sgd"},
        "kfac": {"enabled": True, "grad_worker_fraction": "comm_opt"},
    }
    assert arm_label(_summary(on, True)) == "SGD + K-FAC (COMM-OPT)"
    lamb = {"optimizer": {"name": "lamb"}, "kfac": {"enabled": True, "grad_worker_fraction": "0.5"}}
    assert arm_label(_summary(lamb, True)) == "LAMB + K-FAC (HYBRID-OPT 0.5)"
    mem = {
        "optimizer": {"name": "adamw"},
        "kfac": {"enabled": True, "grad_worker_fraction": "mem_opt"},
    }
    assert arm_label(_summary(mem, True)) == "AdamW + K-FAC (MEM-OPT)"
    one = {"optimizer": {"name": "sgd", "nesterov": True}, "kfac": {"grad_worker_fraction": "1"}}
    assert arm_label(_summary(one, True)) == "SGD (Nesterov) + K-FAC (COMM-OPT)"


def test_a_name_set_on_the_command_line_labels_the_run(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02)
    b = make_run(tmp_path / "b", seed=0, curve=curve(2), epoch_s=0.2, step_s=0.04, kfac="comm_opt")
    (b / ".hydra").mkdir()
    (b / ".hydra" / "overrides.yaml").write_text("- kfac=comm_opt\n- name=my_kfac\n")
    assert [r.label for r in find_runs([a, b])] == ["SGD", "my_kfac"]


def test_baseline_defaults_to_the_first_order_arm_and_can_be_chosen(tmp_path: Path) -> None:
    dirs = arms(tmp_path, sgd=[(4, 0.1)], kfac=[(2, 0.3)])  # K-FAC given first
    runs = find_runs(dirs)
    assert [g.label for g in Comparison(runs).groups] == ["SGD", "SGD + K-FAC (COMM-OPT)"]
    rows = table_rows(runs)
    assert rows[0]["run"] == "SGD" and rows[0]["time_ratio"] == pytest.approx(1.0)
    # SGD 4 epochs x 0.1 s = 0.4 s; K-FAC 2 x 0.3 = 0.6 s: 1.5x the baseline's time.
    assert rows[1]["time_ratio"] == pytest.approx(0.6 / 0.4)
    assert rows[1]["step_time_ratio"] == pytest.approx(0.036 / 0.020)
    chosen = table_rows(runs, baseline="SGD + K-FAC (COMM-OPT)")
    assert chosen[0]["run"] == "SGD + K-FAC (COMM-OPT)"
    assert chosen[1]["time_ratio"] == pytest.approx(0.4 / 0.6)
    assert (
        table_rows(runs, baseline=str(dirs[1]))[0]["run"] == "SGD"
    )  # a run directory names its arm
    with pytest.raises(UserError, match="--baseline 'LAMB' matches no run"):
        table_rows(runs, baseline="LAMB")


def test_seeds_of_one_arm_group_into_median_and_spread(tmp_path: Path) -> None:
    # SGD reaches at epochs 18 and 19 and misses in seed 2; K-FAC at 10, 10, 11.
    sgd = [(18, 0.1), (19, 0.1), (None, 0.1)]
    kfac = [(10, 0.2), (10, 0.2), (11, 0.2)]
    runs = find_runs(arms(tmp_path, sgd=sgd, kfac=kfac))
    base, other = table_rows(runs)
    assert base["seeds"] == other["seeds"] == "0 1 2"
    assert base["reached"] == "2/3" and other["reached"] == "3/3"
    # A missed seed counts as +inf: the median of (1.8, 1.9, inf) is 1.9, the max is unknown.
    assert base["time_to_target_s"] == pytest.approx(1.9) and base[
        "time_to_target_s_min"
    ] == pytest.approx(1.8)
    assert base["time_to_target_s_max"] is None and base["epochs_to_target"] == 19
    assert other["epochs_to_target"] == 10 and other["epochs_to_target_max"] == 11
    assert other["time_to_target_s"] == pytest.approx(2.0) and other[
        "time_to_target_s_max"
    ] == pytest.approx(2.2)
    assert other["status"] == "success" and base["status"] == "success 2, target_not_reached 1"
    assert other["final_metric"] == 0.95 and other["min_metric_after_target"] == 0.95
    assert base["min_metric_after_target_min"] == 0.95 and other[
        "kfac_overhead_pct"
    ] == pytest.approx(40)
    # The time ratio pairs the seeds: 0, 1 and 2, where SGD missed and is censored at its training time
    # (30 epochs of 0.1 s): the interval is open below (SGD might have taken any longer there).
    d = [math.log(2.0 / 1.8), math.log(2.0 / 1.9), math.log(2.2 / 3.0)]
    half = scipy.stats.t.ppf(0.975, 2) * statistics.stdev(d) / math.sqrt(3)
    assert base["time_ratio"] == pytest.approx(1.0) and base["ci_method"] == "baseline"
    assert other["time_ratio"] == pytest.approx(math.exp(statistics.fmean(d)))
    assert other["time_ratio_ci_low"] == 0.0
    assert other["time_ratio_ci_high"] == pytest.approx(math.exp(statistics.fmean(d) + half))
    assert other["ci_method"] == "paired t interval on log ratios, 3 seeds"
    text = render(runs, "terminal")
    assert "median [min-max] over seeds" in text.splitlines()[0]
    ratio_line = next(x for x in text.splitlines() if x.startswith("time to target / baseline's"))
    shown = f"{math.exp(statistics.fmean(d)):.2f} [0-{math.exp(statistics.fmean(d) + half):.2f}]"
    assert ratio_line.endswith(shown)
    # The verdict reads the same interval: it holds 1.
    assert f"time to target {shown}x SGD's: no clear difference on the clock" in text
    line = next(x for x in text.splitlines() if x.startswith("time to target (s)"))
    assert line.split("  ")[-1].strip() == "2.00 [2.00-2.20]" and "1.90 [1.80-miss]" in line
    parsed = list(csv.DictReader(io.StringIO(render(runs, "csv"))))
    assert [r["run"] for r in parsed] == ["SGD", "SGD + K-FAC (COMM-OPT)"]


def test_runs_of_one_arm_with_other_settings_are_separate_arms(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", seed=0, curve=curve(3), epoch_s=0.1, step_s=0.02, lr=0.1)
    b = make_run(tmp_path / "b", seed=0, curve=curve(4), epoch_s=0.1, step_s=0.02, lr=0.2)
    c = make_run(tmp_path / "c", seed=1, curve=curve(5), epoch_s=0.1, step_s=0.02, lr=0.1)
    groups = Comparison(find_runs([a, b, c])).groups
    assert [g.label for g in groups] == ["SGD (optimizer.lr=0.1)", "SGD (optimizer.lr=0.2)"]
    assert [len(g.runs) for g in groups] == [2, 1]


def _verdict(
    tmp_path: Path, sgd: list[tuple[int | None, float]], kfac: list[tuple[int | None, float]]
) -> str:
    (line,) = Comparison(find_runs(arms(tmp_path, sgd=sgd, kfac=kfac))).verdicts()
    return line


def _paired(arm: list[float], base: list[float]) -> str:
    """The ratio and 95 % interval of paired values as the verdict prints them, from the t formula."""
    d = [math.log(a / b) for a, b in zip(arm, base)]
    half = scipy.stats.t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    mean = statistics.fmean(d)
    return f"{math.exp(mean):.2f} [{math.exp(mean - half):.2f}-{math.exp(mean + half):.2f}]"


def test_verdict_kfac_faster_when_the_interval_is_below_one(tmp_path: Path) -> None:
    line = _verdict(tmp_path, sgd=[(18, 0.1), (19, 0.1), (20, 0.1)], kfac=[(10, 0.1)] * 3)
    assert line.startswith(
        "SGD + K-FAC (COMM-OPT) reached top1 >= 0.9 in 3/3 seeds in 10 epochs (median 1.0 s), "
        "SGD in 3/3 in 19 (1.9 s): "
    )
    time = _paired([1.0] * 3, [1.8, 1.9, 2.0])
    epochs = _paired([10] * 3, [18, 19, 20])
    assert f"time to target {time}x SGD's: K-FAC faster on the clock" in line
    assert f"epochs to target {epochs}x: K-FAC needs fewer epochs" in line
    assert "(95 % CI: paired t interval on log ratios, 3 seeds)" in line
    assert "censored" not in line and "fell back" not in line and "fairness" not in line


def test_verdict_sgd_faster_on_the_clock_despite_fewer_kfac_epochs(tmp_path: Path) -> None:
    sgd = [(18, 0.1), (19, 0.1), (20, 0.1)]
    kfac = [(10, 0.3)] * 3  # 3.0 s each
    line = _verdict(tmp_path, sgd=sgd, kfac=kfac)
    time = _paired([3.0] * 3, [1.8, 1.9, 2.0])
    assert f"time to target {time}x SGD's: K-FAC slower on the clock" in line
    assert "K-FAC needs fewer epochs" in line


def test_an_arm_that_missed_a_seed_is_never_called_faster(tmp_path: Path) -> None:
    # K-FAC reaches in 5 epochs (0.5 s) in seeds 0 and 1, SGD in 18 and 19 (1.8 s, 1.9 s); in seed 2
    # K-FAC trains 10 epochs (1.0 s) without reaching the target, SGD reaches at 1.9 s. Reading K-FAC's
    # 1.0 s as its time would make every seed faster; it is only a lower bound, so the interval stays
    # open above and the clock gives no claim.
    dirs = arms(tmp_path, sgd=[(18, 0.1), (19, 0.1), (19, 0.1)], kfac=[(5, 0.1), (5, 0.1)])
    dirs.append(
        make_run(
            tmp_path / "kfac2",
            seed=2,
            curve=curve(None, epochs=10),
            epoch_s=0.1,
            step_s=0.036,
            kfac="comm_opt",
        )
    )
    naive = _paired([0.5, 0.5, 1.0], [1.8, 1.9, 1.9])
    assert float(naive.split("-")[1].rstrip("]")) < 1  # what reading the lower bound would claim
    (line,) = Comparison(find_runs(dirs)).verdicts()
    assert "-inf]x SGD's: no clear difference on the clock (open while runs miss the target" in line
    assert "runs that missed the target censored at their training time, K-FAC: 1" in line
    (row,) = table_rows(find_runs(dirs))[1:]
    assert row["time_ratio_ci_high"] == math.inf and row["reached"] == "2/3"


def test_a_baseline_that_missed_a_seed_still_allows_faster_but_never_slower(tmp_path: Path) -> None:
    # SGD misses seed 2 (censored at 30 epochs of 0.1 s = 3.0 s): K-FAC's 1.0 s there is at most 1/3 of
    # SGD's time, a bound in the direction of "faster", so it enters as it is; the lower end opens.
    line = _verdict(tmp_path, sgd=[(18, 0.1), (19, 0.1), (None, 0.1)], kfac=[(10, 0.1)] * 3)
    d = [math.log(1.0 / 1.8), math.log(1.0 / 1.9), math.log(1.0 / 3.0)]
    high = statistics.fmean(d) + scipy.stats.t.ppf(0.975, 2) * statistics.stdev(d) / math.sqrt(3)
    assert f"time to target {math.exp(statistics.fmean(d)):.2f} [0-{math.exp(high):.2f}]x" in line
    assert "K-FAC faster on the clock" in line
    # SGD stops after 5 epochs (0.5 s) in seed 2 without reaching: K-FAC's 2.5 s there is at most 5x
    # SGD's time. Read as 5x, every seed would be slower; it is an upper bound, so no claim of slower.
    dirs = arms(tmp_path / "b", sgd=[(10, 0.1), (10, 0.1)], kfac=[(25, 0.1)] * 3)
    dirs.append(
        make_run(tmp_path / "b" / "sgd2", seed=2, curve=curve(None, 5), epoch_s=0.1, step_s=0.02)
    )
    naive = _paired([2.5] * 3, [1.0, 1.0, 0.5])
    assert float(naive.split("[")[1].split("-")[0]) > 1  # what reading the lower bound would claim
    (slower,) = Comparison(find_runs(dirs)).verdicts()
    assert "no clear difference on the clock" in slower and "slower" not in slower


def test_verdict_names_an_arm_that_falls_back_below_the_target(tmp_path: Path) -> None:
    dirs = [
        make_run(tmp_path / "s", seed=0, curve=curve(5, dip_at=8), epoch_s=0.1, step_s=0.02),
        make_run(tmp_path / "k", seed=0, curve=curve(3), epoch_s=0.2, step_s=0.04, kfac="comm_opt"),
    ]
    (line,) = Comparison(find_runs(dirs)).verdicts()
    assert line.endswith("; SGD fell back below the target after reaching it in 1/1 seeds")
    assert table_rows(find_runs(dirs))[0]["min_metric_after_target"] == 0.85


def _crashed(tmp_path: Path) -> dict[str, Path]:
    """Runs a crash left behind, each next to a good one: a cut-off last line, an empty summary, a
    half-written summary, no summary at all."""
    dirs = {}
    for seed, name in enumerate(("cut_line", "empty_summary", "half_summary", "no_summary")):
        cfg = compose_run(
            ["+recipe=digits_smoke", "kfac=none", "train.targets.top1=0.9", f"train.seed={seed}"]
        )
        d = tmp_path / name
        d.mkdir(parents=True)
        record_config(d, cfg)  # as the run recorded it when it started
        config = yaml.safe_load((d / "config.yaml").read_text())
        d.rename(tmp_path / "tmp")
        d = make_run(
            d, seed=seed, curve=curve(3, epochs=6), epoch_s=0.5, step_s=0.05, config=config
        )
        (tmp_path / "tmp" / "config.yaml").rename(d / "config.yaml")
        (tmp_path / "tmp").rmdir()
        dirs[name] = d
    with (dirs["cut_line"] / "eval.jsonl").open("a") as f:
        f.write('{"epoch": 7.0, "metrics": {"top1": 0.9')
    (dirs["empty_summary"] / "summary.json").write_text("")
    whole = (dirs["half_summary"] / "summary.json").read_text()
    (dirs["half_summary"] / "summary.json").write_text(whole[: len(whole) // 2])
    (dirs["no_summary"] / "summary.json").unlink()
    return dirs


def test_cut_off_files_give_one_warning_each_and_the_readable_part(tmp_path: Path) -> None:
    dirs = _crashed(tmp_path)
    warnings: list[str] = []
    runs = {r.path.name: r for r in find_runs(list(dirs.values()), on_warning=warnings.append)}
    assert len(warnings) == 5 and all("\n" not in w for w in warnings)
    assert warnings[4].startswith("only one arm (SGD, 4 run(s))")
    assert "cut_line/eval.jsonl: 1 unreadable line(s) skipped" in warnings[0]
    assert "empty or cut off" in warnings[1] and "empty or cut off" in warnings[2]
    assert "summary.json is missing" in warnings[3]
    assert len(runs["cut_line"].evals) == 6 and runs["cut_line"].summary["status"] == "success"
    for name in ("empty_summary", "half_summary", "no_summary"):
        s = runs[name].summary
        # Rebuilt from eval.jsonl (6 epochs of 0.5 s, target first met after epoch 3) and config.yaml.
        assert (
            s["status"] == "no summary"
            and s["target_value"] == 0.9
            and s["target_metric"] == "top1"
        )
        assert s["time_to_target_s"] == 1.5 and s["epochs_to_target"] == 3.0
        assert s["final_metrics"]["top1"] == 0.95 and s["mean_step_time_s"] is None
        assert arm_label(s) == "SGD"
    (row,) = table_rows(list(runs.values()))  # one arm, four readable runs
    assert row["reached"] == "4/4" and row["time_to_target_s"] == statistics.median([1.5] * 4)


@pytest.mark.slow
def test_cli_compares_crashed_runs_with_one_line_warnings(tmp_path: Path) -> None:
    _crashed(tmp_path / "runs")
    result = run_cli("compare", "runs", "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    # One per cut-off file, and one saying all four runs are one arm.
    assert len(lines) == 5 and all(x.startswith("kfac-bench: warning: ") for x in lines)
    assert "Traceback" not in result.stderr
    assert (tmp_path / "out" / "compare.csv").read_text().count("\n") == 2
