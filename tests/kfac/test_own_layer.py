"""docs/engine.md "Your own layer": the worked example, run as written in the docs, is preconditioned
exactly as the same model written with ``nn.Linear`` followed by the scale."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_bench.kfac import KFACPreconditioner, scan_model, unregister_layer_type

D = torch.float64
DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def doc_example() -> dict[str, Any]:
    """Execute the first Python block of the "Your own layer" section."""
    text = DOC.read_text()
    section = text[text.index("## Your own layer") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, Any] = {"__name__": "engine_doc_example"}
    exec(compile(code.group(1), str(DOC), "exec"), namespace)  # the docs' own code
    return namespace


class Scaled(nn.Module):
    def __init__(self, linear: nn.Linear, scale: float) -> None:
        super().__init__()
        self.linear, self.scale = linear, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.linear(x)


@pytest.mark.parametrize("scaling", ["expand", "per_example"])
def test_the_documented_own_layer_equals_its_nn_linear_equivalent(scaling: str) -> None:
    ns = doc_example()
    try:
        torch.manual_seed(0)
        own = nn.Sequential(ns["ScaledLinear"](5, 4, scale=3.0), nn.Tanh(), nn.Linear(4, 2)).to(D)
        linear = nn.Linear(5, 4, dtype=D)
        linear.load_state_dict({"weight": own[0].weight.detach(), "bias": own[0].bias.detach()})
        twin = nn.Sequential(Scaled(linear, 3.0), nn.Tanh(), nn.Linear(4, 2, dtype=D))
        twin[2].load_state_dict(own[2].state_dict())
        assert [s.name for s in scan_model(own).layers] == ["0", "2"]
        x, y = torch.randn(6, 3, 5, dtype=D), torch.randn(6, 3, 2, dtype=D)
        got = []
        for model in (own, twin):
            p = KFACPreconditioner(model, factor_scaling=scaling, kl_clip=None, damping=0.01)
            for _ in range(2):
                model.zero_grad()
                F.mse_loss(model(x), y).backward()
                p.step()
            got.append((p, [q.grad.clone() for q in model.parameters()]))
        (p_own, g_own), (p_twin, g_twin) = got
        assert p_own.layers["0"].ready
        a, g = p_own.layers["0"], p_twin.layers["0.linear"]
        torch.testing.assert_close(a.a_factor, g.a_factor, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a.g_factor, g.g_factor, rtol=1e-12, atol=1e-14)
        for u, v in zip(g_own, g_twin):
            torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-13)
    finally:
        unregister_layer_type(ns["ScaledLinear"])
