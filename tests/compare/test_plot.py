"""``compare.png``'s y range and title: every run and the target in view, the setting named."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kfac_bench.compare.plot import _setting_title, _y_range
from kfac_bench.compare.report import Comparison, find_runs
from kfac_bench.config import model_name
from kfac_bench.config.compose import compose_run
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


@pytest.mark.parametrize(
    ("recipe", "title"),
    [
        ("resnet32_cifar10", "resnet32 on cifar10, global batch 128, ?"),
        ("resnet50_imagenet", "resnet50 on imagenet, global batch 32, ?"),
    ],
)
def test_the_title_names_model_data_batch_and_devices(
    recipe: str, title: str, tmp_path: Path
) -> None:
    # The config a run of the real recipe records (summary.json holds it resolved).
    config = OmegaConf.to_container(
        compose_run([f"+recipe={recipe}"]), resolve=True, enum_to_str=True
    )
    run = make_run(tmp_path / "a", seed=0, curve=curve(2), epoch_s=1, step_s=0.1, config=config)
    cmp = Comparison(find_runs([run], on_warning=lambda _: None))
    # make_run writes no world size or device: one process, the device unknown.
    assert _setting_title(cmp) == title


def test_a_model_is_named_as_users_name_it() -> None:
    assert (
        model_name({"_target_": "x.build_torchvision_resnet", "arch": "resnet152"}) == "resnet152"
    )
    assert model_name({"_target_": "x.cifar_resnet.build_cifar_resnet", "depth": 20}) == "resnet20"
    assert model_name({"_target_": "kfac_bench.models.bert.build_bert", "preset": "large"}) == (
        "bert_large"
    )
    assert model_name({"_target_": "mymodule.build_mlp"}) == "mlp"
    assert model_name(None) == "?"
