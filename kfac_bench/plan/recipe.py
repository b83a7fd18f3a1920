"""A recipe's full-size model on the meta device, the layers the engine would register in it, and the engine
settings that decide what each rank holds and sends.

The config is composed exactly as ``kfac-bench train`` composes it
(:func:`kfac_bench.config.compose.compose_run`), so ``kfac.*`` overrides on the command line
(``kfac.symmetry_aware=true``, ``kfac.comm_dtype=bfloat16``) are planned too. The model is built under
``torch.device("meta")``: shapes without memory, in seconds even for BERT-Large; weight files
(``init_checkpoint``, ``backbone_weights``) are not read, since only shapes matter. The layers come from the
engine's own :func:`~kfac_bench.kfac.scan_model` with the recipe's ``skip_layers`` and the harness's layer
types, i.e. exactly the layers a training run registers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from kfac_bench.config.bounds import validate_run
from kfac_bench.config.compose import compose_run
from kfac_bench.config.kfac_adapter import scaled_interval, torch_dtype
from kfac_bench.data.batching import accumulation_steps, rank_batch
from kfac_bench.errors import ConfigError, UserError
from kfac_bench.kfac import ComputeMethod, LayerSpec, ModelScan, scan_model
from kfac_bench.kfac.options import AssignmentStrategy
from kfac_bench.kfac.preconditioner import resolve_dtypes
from kfac_bench.kfac.second_order import RankRule, SecondOrderMethod, second_order_method
from kfac_bench.kfac.subsample import check_fraction
from kfac_bench.models.layer_types import register_harness_layer_types

from .factors import FactorCalls, factor_calls, model_input
from .length import RunLength, run_length

__all__ = ["EngineSettings", "PlannedModel", "build_meta_model", "engine_settings", "load_recipe"]

#: Model-builder arguments that name weight files: not read when planning (shapes only).
WEIGHT_FILE_KEYS = ("init_checkpoint", "backbone_weights")
_META = torch.device("meta")


@dataclass(frozen=True)
class EngineSettings:
    """The ``KFACPreconditioner`` arguments of a recipe that decide memory and traffic per rank."""

    factor_dtype: torch.dtype
    inv_dtype: torch.dtype
    comm_dtype: torch.dtype  # the factor dtype when the recipe sets none
    grad_dtype: torch.dtype  # the parameters' dtype: what a preconditioned gradient is written in
    compute_method: ComputeMethod
    method: SecondOrderMethod
    colocate_factors: bool
    assignment_strategy: AssignmentStrategy
    bucket_cap_mb: float
    symmetry_aware: bool
    factor_update_steps: int
    inv_update_steps: int
    reference_world_size: int | None
    # Which rows the factor products use (kfac_bench.plan.factors); the factors keep their size.
    factor_batch_fraction: float = 1.0
    factor_position_fraction: float = 1.0

    def part_bytes(self, a_dim: int, g_dim: int) -> dict[str, int]:
        """Bytes of each second-order part of an ``(a_dim, g_dim)`` layer ("a", "g" and the method's
        derived parts), from the shapes and dtypes the engine's own receive buffers have."""
        return dict(_part_bytes(self.method, a_dim, g_dim))  # type: ignore[arg-type]

    def intervals(self, world_size: int) -> tuple[int, int]:
        """(factor, decomposition) update intervals in steps on ``world_size`` ranks: the recipe's values,
        scaled by ``reference_world_size / world_size`` when set, by the adapter's own rule."""
        return (
            scaled_interval(self.factor_update_steps, self.reference_world_size, world_size),
            scaled_interval(self.inv_update_steps, self.reference_world_size, world_size),
        )


@dataclass
class PlannedModel:
    """What the planner knows about a recipe's run before it starts."""

    recipe: str
    model: nn.Module  # on the meta device
    scan: ModelScan
    settings: EngineSettings
    skip_layers: tuple[str, ...]
    model_target: str
    model_args: dict[str, Any]
    precision: str
    batch_size: int
    global_batch_size: int | None
    default_accumulation: int
    factor_calls: FactorCalls
    # The recipe's strategy, placement and factor reduction (the time-to-solution projection's K-FAC arm),
    # and its length.
    grad_worker_fraction: str = "comm_opt"
    placement: str = "lpt"
    factor_reduction: str = "allreduce"
    length: RunLength | None = None

    @property
    def layers(self) -> list[LayerSpec]:
        return self.scan.layers

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per step on ``world_size`` ranks (1 where the global batch does not divide)."""
        try:
            return accumulation_steps(
                rank_batch(self.batch_size, world_size, self.global_batch_size),
                world_size,
                self.global_batch_size,
                self.default_accumulation,
            )
        except ConfigError:
            return 1


@functools.lru_cache(maxsize=4096)
def _part_bytes(method: SecondOrderMethod, a_dim: int, g_dim: int) -> tuple[tuple[str, int], ...]:
    out = []
    for part in ("a", "g", *method.derived):
        tensors = method.empty(part, a_dim, g_dim, _META).values()
        out.append((part, sum(t.numel() * t.element_size() for t in tensors)))
    return tuple(out)


def build_meta_model(model_cfg: Any) -> nn.Module:
    """Instantiate a ``model`` config on the meta device, without reading weight files.

    Raises:
        UserError: the builder rejected its arguments (one line).
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    args = (
        OmegaConf.to_container(model_cfg, resolve=True)
        if isinstance(model_cfg, DictConfig)
        else dict(model_cfg)
    )
    assert isinstance(args, dict)
    for key in WEIGHT_FILE_KEYS:
        if key in args:
            args[key] = None
    try:
        with _META:
            model = instantiate(args, _convert_="all")
    except InstantiationException as exc:
        if isinstance(exc.__cause__, UserError):
            raise exc.__cause__ from None
        raise
    if not isinstance(model, nn.Module):
        raise TypeError(f"model builder {args.get('_target_')} returned {type(model).__name__}")
    return model


def engine_settings(
    model: nn.Module,
    *,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
    compute_eigenvalue_outer_product: bool = True,
    colocate_factors: bool = True,
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    allreduce_bucket_cap_mb: float = 25.0,
    symmetry_aware: bool = False,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
    reference_world_size: int | None = None,
    lowrank_fraction: float = 0.25,
    lowrank_min_dim: int = 1024,
    factor_batch_fraction: float = 1.0,
    factor_position_fraction: float = 1.0,
) -> EngineSettings:
    """The settings of ``KFACPreconditioner(model, **same keyword arguments)``, resolved as the engine
    resolves them (dtypes from the model, the second-order method with or without the outer product)."""
    factor, inv = resolve_dtypes(model, factor_dtype, inv_dtype)
    method = ComputeMethod.parse(compute_method)
    param = next(model.parameters(), None)
    return EngineSettings(
        factor_dtype=factor,
        inv_dtype=inv,
        comm_dtype=comm_dtype or factor,
        grad_dtype=param.dtype if param is not None else torch.float32,
        compute_method=method,
        # The preconditioner's own choice: the outer product needs A and G on one rank.
        method=second_order_method(
            method,
            inv,
            compute_eigenvalue_outer_product and colocate_factors,
            RankRule(lowrank_fraction, lowrank_min_dim),
        ),
        colocate_factors=colocate_factors,
        assignment_strategy=AssignmentStrategy.parse(assignment_strategy),
        bucket_cap_mb=float(allreduce_bucket_cap_mb),
        symmetry_aware=symmetry_aware,
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
        reference_world_size=reference_world_size,
        factor_batch_fraction=check_fraction(factor_batch_fraction),
        factor_position_fraction=check_fraction(
            factor_position_fraction, "factor_position_fraction"
        ),
    )


def _settings(model: nn.Module, kfac: Any) -> EngineSettings:
    """:func:`engine_settings` of a ``kfac`` config node (integer intervals; epoch decays not planned)."""
    return engine_settings(
        model,
        factor_dtype=torch_dtype(kfac.factor_dtype, "factor_dtype"),
        inv_dtype=torch_dtype(kfac.inv_dtype, "inv_dtype"),
        comm_dtype=torch_dtype(kfac.comm_dtype, "comm_dtype"),
        compute_method=str(kfac.compute_method.value),
        compute_eigenvalue_outer_product=bool(kfac.compute_eigenvalue_outer_product),
        colocate_factors=bool(kfac.colocate_factors),
        assignment_strategy=str(kfac.assignment_strategy.value),
        allreduce_bucket_cap_mb=float(kfac.allreduce_bucket_cap_mb),
        symmetry_aware=bool(kfac.symmetry_aware),
        factor_update_steps=int(kfac.factor_update_steps),
        inv_update_steps=int(kfac.inv_update_steps),
        reference_world_size=kfac.reference_world_size,
        lowrank_fraction=float(kfac.lowrank_fraction),
        lowrank_min_dim=int(kfac.lowrank_min_dim),
        factor_batch_fraction=float(kfac.factor_batch_fraction),
        factor_position_fraction=float(kfac.factor_position_fraction),
    )


def load_recipe(overrides: Sequence[str], dataset_size: int | None = None) -> PlannedModel:
    """Compose ``overrides`` (the ``kfac-bench train`` command line), check its values as ``train`` does,
    and scan the full-size model (``dataset_size``: training examples, where the config does not say).

    Raises:
        ConfigError: unknown recipe or key, a bad value, or a recipe that trains without K-FAC.
    """
    cfg = compose_run(overrides, return_hydra_config=True)
    validate_run(cfg)
    recipe = str(cfg.hydra.runtime.choices.get("recipe", cfg.name))
    if not cfg.kfac.enabled:
        raise ConfigError(
            f"recipe '{recipe}' trains without K-FAC (kfac.enabled=false): plan its K-FAC arm instead, "
            "e.g. +recipe=resnet50_imagenet"
        )
    model = build_meta_model(cfg.model)
    register_harness_layer_types()
    skip = tuple(str(s) for s in cfg.kfac.skip_layers)
    scan = scan_model(model, skip)
    if not scan.layers:
        raise ConfigError(
            f"recipe '{recipe}': K-FAC registers no layer of its model (kfac.skip_layers?)"
        )
    args = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(args, dict)
    t = cfg.train
    settings = _settings(model, cfg.kfac)
    calls = factor_calls(
        model,
        scan.layers,
        model_input(cfg.dataset, int(t.batch_size)),
        settings.factor_batch_fraction,
        settings.factor_position_fraction,
    )
    return PlannedModel(
        recipe=recipe,
        model=model,
        scan=scan,
        settings=settings,
        skip_layers=skip,
        model_target=str(args.pop("_target_")),
        model_args={str(k): v for k, v in args.items()},
        precision=str(t.precision.value),
        batch_size=int(t.batch_size),
        global_batch_size=t.global_batch_size,
        default_accumulation=int(t.accumulation_steps),
        factor_calls=calls,
        grad_worker_fraction=str(cfg.kfac.grad_worker_fraction),
        placement=str(cfg.kfac.placement.value),
        factor_reduction=str(cfg.kfac.factor_reduction.value),
        length=run_length(cfg, recipe, dataset_size),
    )
