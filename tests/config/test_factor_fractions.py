"""``kfac.factor_batch_fraction`` / ``kfac.factor_position_fraction``: from the command line to the engine."""

from __future__ import annotations

import pytest
import torch

from kfac_bench.config.bounds import validate_run
from kfac_bench.config.compose import compose_run
from kfac_bench.config.kfac_adapter import build_preconditioner
from kfac_bench.errors import ConfigError
from kfac_bench.models.small_cnn import build_small_cnn

FIELDS = ("factor_batch_fraction", "factor_position_fraction")


@pytest.mark.parametrize("field", FIELDS)
def test_a_fraction_reaches_the_preconditioner(field: str) -> None:
    other = next(f for f in FIELDS if f != field)
    # digits' K-FAC arm sets factor_batch_fraction=0.25 itself: the other field is set to 1 here.
    cfg = compose_run(["+recipe=digits", f"kfac.{field}=0.25", f"kfac.{other}=1.0"])
    assert getattr(cfg.kfac, field) == 0.25
    p = build_preconditioner(
        build_small_cnn(), cfg.kfac, steps_per_epoch=5, world_size=1, accumulation_steps=1, lr=0.1
    )
    assert getattr(p, field) == 0.25
    assert getattr(p, other) == 1.0  # each field reaches the engine alone
    x = torch.randn(4, 1, 8, 8)
    p.model(x).sum().backward()
    p.step()  # a step with the thinned-out factors runs
    assert all(torch.isfinite(s.a_factor).all() for s in p.layers.values())


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", ["0.0", "1.5"])
def test_a_fraction_outside_zero_one_is_a_config_error(field: str, value: str) -> None:
    cfg = compose_run([f"kfac.{field}={value}"])
    with pytest.raises(ConfigError, match=rf"kfac\.{field}={value}: must be in \(0, 1\]"):
        validate_run(cfg)
