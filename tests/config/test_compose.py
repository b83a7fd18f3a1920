"""Every config group option and every recipe composes; config mistakes give one-line ConfigErrors."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from kfac_bench.config import config_dir, recipes_dir
from kfac_bench.config.compose import compose_run
from kfac_bench.config.kfac_adapter import FROM_LOOP, HARNESS_ONLY
from kfac_bench.config.schema import KFACConfig
from kfac_bench.config.store import recipe_names
from kfac_bench.errors import ConfigError

GROUPS = sorted(p.name for p in config_dir().iterdir() if p.is_dir() and p.name != "hydra")
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((config_dir() / g).glob("*.yaml"))]


def test_groups_are_the_documented_ones() -> None:
    for group in ("model", "dataset", "task", "optimizer", "lr_schedule", "kfac", "launcher"):
        assert group in GROUPS
    assert {"none", "comm_opt", "mem_opt", "hybrid_opt"} <= {o for g, o in OPTIONS if g == "kfac"}
    assert {"local", "torchrun"} <= {o for g, o in OPTIONS if g == "launcher"}


@pytest.mark.parametrize(("group", "option"), OPTIONS)
def test_every_option_composes(group: str, option: str) -> None:
    cfg = compose_run([f"{group}={option}"], return_hydra_config=True)
    assert cfg.hydra.runtime.choices[group] == option


@pytest.mark.parametrize(("group", "option"), OPTIONS)
def test_every_option_declares_its_schema_first(group: str, option: str) -> None:
    data = yaml.safe_load((config_dir() / group / f"{option}.yaml").read_text())
    first = data["defaults"][0]
    assert (
        isinstance(first, str)
        and first.startswith(f"/schema/{group}/")
        and first.endswith("@_here_")
    )


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_composes(name: str) -> None:
    text = (recipes_dir() / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_")
    assert "kfac-bench train" in text.split("defaults:")[0], "launch command comment at the top"
    cfg = compose_run([f"+recipe={name}"])
    assert cfg.name == name.removesuffix("_smoke") or cfg.name == name


def test_recipe_values_win_over_defaults_and_command_line_wins_over_recipe() -> None:
    cfg = compose_run(["+recipe=digits_smoke"])
    assert cfg.model.channels == 8 and cfg.train.limit_train_batches == 8
    cfg = compose_run(["+recipe=digits_smoke", "model.channels=3", "kfac=none"])
    assert cfg.model.channels == 3 and cfg.kfac.enabled is False


def test_a_selected_recipe_replaces_the_default_one_as_a_whole() -> None:
    default = compose_run([])
    assert list(default.lr_schedule.milestones) == [25] and dict(default.train.targets) == {
        "top1": 0.985
    }
    assert default.train.cpu_threads == 1
    for form in (
        "+recipe=resnet32_cifar10",
        "recipe=resnet32_cifar10",
        "++recipe=resnet32_cifar10",
    ):
        cfg = compose_run([form])
        # Nothing of the digits recipe leaks in: keys it sets and this recipe does not are defaults.
        assert cfg.train.cpu_threads is None and dict(cfg.train.targets) == {"top1": 0.9249}
        assert cfg.name == "resnet32_cifar10"


SMOKE_TWINS = [n for n in recipe_names() if n.endswith("_smoke")]


def _leaves(node: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, object] = {}
    for key, value in node.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


@pytest.mark.parametrize("twin", SMOKE_TWINS)
def test_smoke_twins_are_deltas_over_their_full_recipe(twin: str) -> None:
    parent = twin.removesuffix("_smoke")
    data = yaml.safe_load((recipes_dir() / f"{twin}.yaml").read_text())
    defaults = data.pop("defaults")
    assert defaults[0] == parent and defaults[-1] == "_self_"
    assert all(
        isinstance(d, dict) and next(iter(d)).startswith("override /") for d in defaults[1:-1]
    )
    # The full recipe is the single source of its numbers: a twin never restates one of them (a copy would
    # silently keep the old value when the full recipe changes).
    full = _leaves(OmegaConf.to_container(compose_run([f"+recipe={parent}"]), resolve=False))
    restated = {k: v for k, v in _leaves(data).items() if k in full and full[k] == v}
    assert not restated, f"{twin} restates {parent}'s values: {restated}"
    # ...and every full-recipe value the twin does not set reaches the twin.
    own = _leaves(data)
    smoke = _leaves(OmegaConf.to_container(compose_run([f"+recipe={twin}"]), resolve=False))
    overridden = {next(iter(d)).removeprefix("override /") for d in defaults[1:-1]}
    for key, value in full.items():
        if key not in own and key.split(".")[0] not in overridden and key != "name":
            assert smoke[key] == value, (twin, key)


def test_default_job_is_digits_with_kfac() -> None:
    cfg = compose_run([])
    assert cfg.dataset._target_.endswith("build_digits") and cfg.kfac.enabled
    assert cfg.optimizer.name.value == "sgd" and cfg.train.targets["top1"] > 0.9


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.epochz=3"], "unknown config key 'train.epochz'"),
        (["kfac.dampin=0.1"], "unknown config key 'kfac.dampin'"),
        (["+recipe=digits", "model.chanels=3"], "unknown config key 'model.chanels'"),
        (["+recipe=nope"], "unknown recipe 'nope'; valid names: "),
        (["model=nope"], "unknown model 'nope'; valid names: "),
        (["dataset=nope"], "unknown dataset 'nope'; valid names: "),
        (["kfac=bogus"], "unknown kfac 'bogus'; valid names: comm_opt, hybrid_opt, mem_opt, none"),
        (["kfac.compute_method=svd"], "expected one of [eigen, inverse, eigen_lowrank]"),
        (["train.epochs=abc"], "invalid override 'train.epochs=abc'"),
    ],
)
def test_config_mistakes_are_one_line(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_run(overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_unknown_model_lists_every_model_file() -> None:
    with pytest.raises(ConfigError) as info:
        compose_run(["model=nope"])
    for f in (config_dir() / "model").glob("*.yaml"):
        assert f.stem in str(info.value)


def test_submitit_launcher_config_needs_the_plugin_but_does_not_break_composition() -> None:
    pytest.importorskip("hydra", reason="hydra missing")
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401

        plugin = True
    except ImportError:
        plugin = False
    # The default composition never touches the launcher file.
    compose_run([], return_hydra_config=True)
    if plugin:
        cfg = compose_run(["hydra/launcher=kfac_slurm"], return_hydra_config=True)
        assert cfg.hydra.launcher.tasks_per_node == 1
    else:
        with pytest.raises(ConfigError, match=r"pip install 'kfac-bench\[slurm\]'"):
            compose_run(["hydra/launcher=kfac_slurm"], return_hydra_config=True)
    data = yaml.safe_load((config_dir() / "hydra" / "launcher" / "kfac_slurm.yaml").read_text())
    assert data["defaults"][0] == "submitit_slurm" and data["tasks_per_node"] == 1


def test_kfac_schema_names_are_the_engine_keywords() -> None:
    engine = pytest.importorskip("kfac_bench.kfac")
    params = inspect.signature(engine.KFACPreconditioner.__init__).parameters
    engine_kwargs = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - FROM_LOOP
    schema = {f.name for f in fields(KFACConfig)} - HARNESS_ONLY
    assert schema == engine_kwargs
    assert HARNESS_ONLY.isdisjoint(params) and set(params) | {"model"} >= FROM_LOOP


def test_config_dir_is_the_source_tree_in_a_checkout() -> None:
    assert config_dir() == Path(__file__).resolve().parents[2] / "configs"
    assert (recipes_dir() / "README.md").is_file()
