"""``compare.png``'s y range and title: every run and the target in view, the setting named."""

from __future__ import annotations

from pathlib import Path

from kfac_bench.compare.plot import _setting_title, _y_range
from kfac_bench.compare.report import Comparison, find_runs
from tests.compare.test_arms import curve, make_run


def test_runs_far_below_an_accuracy_target_stay_in_view_with_the_target() -> None:
    # A smoke run: the target 0.9 is far above both arms' curves (0.1-0.3): both and the target show.
    sgd, kfac = [0.10, 0.12, 0.11], [0.15, 0.25, 0.30]
    low, high = _y_range([sgd, kfac], 0.9, True)
    assert low < min(sgd) and high > 0.9


def test_an_accuracy_target_zooms_on_the_approach_but_keeps_each_run() -> None:
    # Zoom: ten times the target's distance to 1 below it (0.985 - 0.15) hides the first epochs' climb...
    climbing = [0.1, 0.5, 0.9, 0.99]
    low, high = _y_range([climbing], 0.985, True)
    assert 0.5 < low < 0.9 and high > 0.99
    # ... but never hides a run whose best value is below the zoom.
    low, _ = _y_range([climbing, [0.2, 0.4]], 0.985, True)
    assert low < 0.4


def test_a_lower_is_better_target_above_every_value_is_in_view() -> None:
    low, high = _y_range([[3.0, 2.0, 1.5]], 4.0, False)
    assert low < 1.5 and high > 4.0


def test_the_title_names_model_data_batch_and_devices(tmp_path: Path) -> None:
    config = {
        "name": "x",
        "model": {"_target_": "kfac_bench.models.resnet.build_resnet32"},
        "dataset": {"_target_": "kfac_bench.data.cifar.build_cifar10"},
        "optimizer": {"name": "sgd"},
        "kfac": {"enabled": False},
        "train": {"seed": 0, "batch_size": 128, "global_batch_size": None},
        "task": {"target_metric": "top1"},
    }
    run = make_run(tmp_path / "a", seed=0, curve=curve(2), epoch_s=1, step_s=0.1, config=config)
    cmp = Comparison(find_runs([run], on_warning=lambda _: None))
    # make_run writes no world size or device: one process, the device unknown.
    assert _setting_title(cmp) == "resnet32 on cifar10, global batch 128, ?"
