"""Layer-type registry, the coverage report, tied weights across module types, and the model scan."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import (
    Conv2dHandler,
    KFACPreconditioner,
    LinearHandler,
    layer_types,
    register_layer_type,
    scan_model,
    unregister_layer_type,
)


class MyDense(nn.Module):
    """A Linear-equivalent layer the engine does not know: ``y = x Wᵀ + b``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in, dtype=torch.float64) * 0.3)
        self.bias = nn.Parameter(torch.zeros(d_out, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@pytest.fixture
def my_dense_registered():  # type: ignore[no-untyped-def]
    register_layer_type(MyDense, LinearHandler())
    yield
    unregister_layer_type(MyDense)


def test_linear_and_conv2d_are_registered_like_any_other_type() -> None:
    types = layer_types()
    assert isinstance(types[nn.Linear], LinearHandler) and isinstance(
        types[nn.Conv2d], Conv2dHandler
    )


def test_a_registered_type_is_preconditioned_like_its_builtin_equivalent(
    my_dense_registered,
) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(MyDense(5, 7), nn.Tanh(), MyDense(7, 3))
    twin = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    twin.load_state_dict(model.state_dict())
    p, q = KFACPreconditioner(model), KFACPreconditioner(twin)
    assert set(p.layers) == set(q.layers) == {"0", "2"}
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    for m in (model, twin):
        F.cross_entropy(m(x), y).backward()
    p.step()
    q.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


def test_unregistered_types_are_reported_and_subclasses_use_their_parents_handler() -> None:
    class Sub(nn.Linear):
        pass

    model = nn.Sequential(MyDense(5, 7), Sub(7, 3))
    p = KFACPreconditioner(model)
    assert set(p.layers) == {"1"}
    cov = p.coverage()
    assert cov.left_out["unsupported_type"] == ("0",) and cov.unsupported_types == {"MyDense": 1}
    with pytest.raises(TypeError, match="lacks"):
        register_layer_type(MyDense, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not an nn\.Module"):
        register_layer_type(int, LinearHandler())  # type: ignore[arg-type]


def test_coverage_counts_parameters_by_hand(caplog: pytest.LogCaptureFixture) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)  # unsupported type: 40
            self.fc = nn.Linear(4, 8)  # preconditioned: 32 + 8
            self.norm = nn.LayerNorm(8)  # not eligible (vectors only): 16
            self.conv = nn.Conv2d(8, 8, 3, groups=2)  # grouped: 8*4*9 + 8 = 296
            self.head = nn.Linear(8, 3)  # skipped by rule: 24 + 3
            self.frozen = nn.Linear(8, 8)  # not trainable: ignored everywhere
            self.frozen.requires_grad_(False)

    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(Net(), skip_layers=["^head$"])
    cov = p.coverage()
    assert cov.layers == 1 and cov.preconditioned_params == 40
    assert cov.trainable_params == 40 + 40 + 16 + 296 + 27
    assert cov.eligible_params == 40 + 40 + 296 + 27
    assert cov.left_out == {
        "skipped_by_rule": ("head",),
        "unsupported_type": ("emb",),
        "grouped_conv": ("conv",),
    }
    assert cov.eligible_share == pytest.approx(40 / 403) and cov.below_threshold
    d = json.loads(json.dumps(cov.to_dict()))
    assert d["left_out"]["grouped_conv"] == ["conv"] and d["preconditioned_params"] == 40
    line = str(cov)
    assert "\n" not in line and "grouped conv 1 (conv)" in line and "Embedding×1" in line
    messages = [r.getMessage() for r in caplog.records]
    assert line in messages  # the construction log line
    assert sum("threshold 50%" in m for m in messages) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kfac_bench.kfac"):
        KFACPreconditioner(Net(), skip_layers=["^head$"], coverage_threshold=0.05)
    assert not any("threshold" in r.getMessage() for r in caplog.records)


def test_a_layer_tied_to_an_embedding_is_left_out_with_one_line_naming_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(20, 6)
            self.mix = nn.Linear(6, 6)
            self.lm_head = nn.Linear(6, 20, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(torch.tanh(self.mix(self.wte(ids))))

    model = LM()
    plain = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="kfac_bench.kfac"):
        p = KFACPreconditioner(model)
    assert set(p.layers) == {"mix"}
    lines = [r.getMessage() for r in caplog.records if "tied" in r.getMessage()]
    assert len(lines) == 1 and "'lm_head'" in lines[0] and "'wte'" in lines[0]
    ids = torch.randint(0, 20, (4, 5))
    for m in (model, plain):
        F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
    p.step()
    assert torch.equal(model.wte.weight.grad, plain.wte.weight.grad)  # embedding + head, untouched


def test_unknown_module_types_never_crash() -> None:
    class Raising(LinearHandler):
        def dims(self, module: nn.Module, bias: bool) -> tuple[int, int]:
            raise RuntimeError("cannot read this layer")

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()

    class IntLinear(nn.Linear):
        pass

    int_linear = IntLinear(4, 4)
    int_linear.weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
    int_linear.bias.requires_grad_(True)
    model = nn.Sequential(
        nn.LazyLinear(4),  # no shape yet
        Odd(),
        nn.Linear(3, 4),
        int_linear,
        nn.Bilinear(4, 4, 2),
        nn.ConvTranspose2d(1, 1, 2),
    )
    register_layer_type(Odd, Raising())
    try:
        p = KFACPreconditioner(model)
    finally:
        unregister_layer_type(Odd)
    assert set(p.layers) == {"2"}
    left = p.coverage().left_out
    assert left["unsupported_config"] == ("1",)  # the failing handler
    assert left["lazy_uninitialised"] == ("0",)
    assert set(left["unsupported_type"]) == {"4", "5"}


def test_scan_on_the_meta_device_lists_layers_and_factor_sizes_without_allocating() -> None:
    from torchvision.models import resnet18

    with torch.device("meta"):
        meta = resnet18()
    scan = scan_model(meta, skip_layers=["^fc$"])
    specs = {s.name: s for s in scan.layers}
    assert (
        specs["conv1"].a_dim == 3 * 7 * 7 and specs["conv1"].g_dim == 64 and not specs["conv1"].bias
    )
    assert specs["layer4.1.conv2"].a_dim == 512 * 9 and len(specs) == 20
    assert scan.coverage().left_out["skipped_by_rule"] == ("fc",)
    torch.manual_seed(0)
    real = KFACPreconditioner(resnet18(), skip_layers=["^fc$"])
    assert [(n, s.a_dim, s.g_dim) for n, s in real.layers.items()] == [
        (s.name, s.a_dim, s.g_dim) for s in scan.layers
    ]
