"""Every recipe says where its hyperparameters come from, and the record cannot drift from the recipe: the
tuned values equal the composed config's, the arm is the recipe's own (K-FAC or its optimizer)."""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import OmegaConf

from kfac_bench.config.compose import compose_run
from kfac_bench.config.store import recipe_names

FULL = [n for n in recipe_names() if not n.endswith("_smoke")]
SMOKE = [n for n in recipe_names() if n.endswith("_smoke")]


def _leaves(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out += _leaves(value, path) if isinstance(value, dict) else [(path, value)]
    return out


@pytest.mark.parametrize("name", FULL)
def test_a_recipe_records_its_arm_source_and_values_and_they_match_its_config(name: str) -> None:
    cfg = compose_run([f"+recipe={name}"])
    tuning = OmegaConf.to_container(cfg.tuning, resolve=True)
    assert isinstance(tuning, dict)
    assert tuning["source"], f"{name}: no tuning source"
    kfac_on = bool(cfg.kfac.enabled)
    expected_arm = "kfac" if kfac_on else str(cfg.optimizer.name.value).lower()
    assert tuning["arm"] == expected_arm
    values = tuning["values"]
    assert "lr" in values["optimizer"] and values["lr_schedule"]
    assert ("damping" in values.get("kfac", {})) or not kfac_on
    leaves = _leaves(values)
    for path, value in leaves:
        actual = OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(cfg, path)}))["v"]
        assert actual == pytest.approx(value) if isinstance(value, float) else actual == value, (
            f"{name}: tuning.values.{path} = {value!r}, the recipe's config has {actual!r}"
        )
    # The record's values are real keys of the config, not a parallel vocabulary.
    assert all(OmegaConf.select(cfg, p, default="<missing>") != "<missing>" for p, _ in leaves)


@pytest.mark.parametrize("name", SMOKE)
def test_a_smoke_twin_declares_itself_untuned(name: str) -> None:
    assert compose_run([f"+recipe={name}"]).tuning.source is None
