"""One source for each choice: every schema is its builder's signature (names and defaults), K-FAC's closed
choices are the engine's enums by value, every dataset builder returns the data contract, and no
``_target_`` points into ``config/``."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest
from hydra.utils import get_method

from kfac_bench import kfac
from kfac_bench.config import config_dir, recipes_dir, schema
from kfac_bench.config.compose import compose_run
from kfac_bench.config.families import SCHEMAS as FAMILY_SCHEMAS
from kfac_bench.data.base import DataSplits

BUILDER_SCHEMAS = [
    (group, name, cls)
    for group, name, cls in [*schema.SCHEMAS, *FAMILY_SCHEMAS]
    if "_target_" in {f.name for f in dataclasses.fields(cls)}
]
ENGINE_ENUMS = {
    "compute_method": kfac.ComputeMethod,
    "factor_scaling": kfac.FactorScaling,
    "assignment_strategy": kfac.AssignmentStrategy,
    "placement": kfac.Placement,
    "factor_reduction": kfac.FactorReduction,
}


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return inspect.Parameter.empty


def _target(cls: type) -> str:
    return next(f.default for f in dataclasses.fields(cls) if f.name == "_target_")


def test_every_model_dataset_and_task_option_has_a_builder_schema() -> None:
    covered = {(group, name) for group, name, _ in BUILDER_SCHEMAS}
    for group in ("model", "dataset", "task"):
        for option in (config_dir() / group).glob("*.yaml"):
            assert (group, option.stem) in covered, f"{group}/{option.name} has no schema"


@pytest.mark.parametrize(
    ("group", "name", "cls"), BUILDER_SCHEMAS, ids=[f"{g}/{n}" for g, n, _ in BUILDER_SCHEMAS]
)
def test_schema_is_its_builders_signature(group: str, name: str, cls: type) -> None:
    builder = get_method(_target(cls))
    params = [
        p
        for p in inspect.signature(builder).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    fields = [f for f in dataclasses.fields(cls) if f.name != "_target_"]
    assert [p.name for p in params] == [f.name for f in fields], f"{group}/{name}: names or order"
    for p, f in zip(params, fields, strict=True):
        default = list(p.default) if isinstance(p.default, tuple) else p.default
        assert default == _default(f) and type(default) is type(_default(f)), (
            f"{group}/{name}.{f.name}: builder default {p.default!r}, schema default {_default(f)!r}"
        )


@pytest.mark.parametrize(
    "cls", [c for g, _, c in BUILDER_SCHEMAS if g == "dataset"], ids=lambda c: c.__name__
)
def test_every_dataset_builder_returns_the_data_contract(cls: type) -> None:
    returns = inspect.signature(get_method(_target(cls))).return_annotation
    assert returns in (DataSplits, "DataSplits")


def test_no_target_points_into_config() -> None:
    targets = [_target(c) for _, _, c in BUILDER_SCHEMAS]
    for path in [*config_dir().rglob("*.yaml"), *recipes_dir().glob("*.yaml")]:
        targets += re.findall(r"_target_:\s*(\S+)", path.read_text())
    assert targets and not [t for t in targets if t.startswith("kfac_bench.config")]


@pytest.mark.parametrize("field", sorted(ENGINE_ENUMS))
def test_kfac_choices_are_the_engines_enums_by_value(field: str) -> None:
    engine = ENGINE_ENUMS[field]
    config_enum = type(getattr(schema.KFACConfig(), field))
    assert [m.value for m in config_enum] == [m.value for m in engine]
    assert [m.name for m in config_enum] == [m.value for m in engine]  # OmegaConf parses names
    for member in engine:
        cfg = compose_run([f"kfac.{field}={member.value}"])
        assert getattr(cfg.kfac, field).value == member.value
        assert engine.parse(getattr(cfg.kfac, field).value) is member
