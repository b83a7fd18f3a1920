"""A small, readable dense reference for K-FAC, written independently of the engine's code paths.

Factors are computed from explicit per-example inputs and per-example output gradients (no hooks, no
fast paths); preconditioning is a dense solve against the Kronecker product built with ``torch.kron``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def vec(x: torch.Tensor) -> torch.Tensor:
    """Column-major vectorisation, for which (A ⊗ G) vec(X) = vec(G X A) with symmetric A."""
    return x.t().reshape(-1)


def unvec(v: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return v.reshape(cols, rows).t()


def layer_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Input rows (N, T, a_dim) of a Linear or Conv2d layer, bias 1 appended: patches built with unfold."""
    if isinstance(layer, nn.Conv2d):
        left, right, top, bottom = layer._reversed_padding_repeated_twice
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        xp = F.pad(x, (left, right, top, bottom), mode=mode)
        cols = F.unfold(xp, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)
        rows = cols.transpose(1, 2)  # (N, T, C*kh*kw)
    else:
        rows = x.reshape(x.shape[0], -1, x.shape[-1])
    if layer.bias is not None:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
    return rows


def output_rows(layer: nn.Module, d: torch.Tensor) -> torch.Tensor:
    """Per-position output gradients (N, T, g_dim)."""
    if isinstance(layer, nn.Conv2d):
        return d.flatten(2).transpose(1, 2)
    return d.reshape(d.shape[0], -1, d.shape[-1])


def per_example_output_grads(layer: nn.Module, x: torch.Tensor, head, targets) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """δₙ = ∂ℓₙ/∂(output of example n), from the *summed* loss (examples are independent)."""
    out = layer(x)
    out.retain_grad()
    loss = F.cross_entropy(head(out), targets, reduction="sum")
    loss.backward()
    return out.grad.detach()


def kfac_factors(
    layer: nn.Module, x: torch.Tensor, delta: torch.Tensor, scaling: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G of one batch, straight from the definitions in kfac_bench/kfac/factors.py's docstring."""
    a = layer_rows(layer, x)
    d = output_rows(layer, delta)
    n, t = a.shape[0], a.shape[1]
    if scaling == "expand" and not isinstance(layer, nn.Conv2d):
        # K-FAC-expand: each of the R = n·t rows is a term of the loss's mean (the one layer sees them all).
        rows, g = a.reshape(n * t, -1), (d / n).reshape(n * t, -1)
        return rows.t() @ rows / (n * t), (g.t() @ g) * (n * t)
    if scaling in ("per_example", "expand"):
        A = sum(a[i].t() @ a[i] for i in range(n)) / n
        G = sum(d[i].t() @ d[i] / t for i in range(n)) / n
        return A, G
    g = d / n  # the gradient of the mean loss
    s = 1.0 / t**2 if isinstance(layer, nn.Conv2d) else 1.0
    A = (a.reshape(n * t, -1).t() @ a.reshape(n * t, -1)) * s / (n * t)
    G = (g.reshape(n * t, -1).t() @ g.reshape(n * t, -1)) * s / (n * t)
    return A, G


def eigen_dense(
    A: torch.Tensor, G: torch.Tensor, grad: torch.Tensor, damping: float
) -> torch.Tensor:
    """(A ⊗ G + γI)⁻¹ vec(∇W), reshaped back to ∇W's shape."""
    K = torch.kron(A, G)
    sol = torch.linalg.solve(K + damping * torch.eye(K.shape[0], dtype=K.dtype), vec(grad))
    return unvec(sol, *grad.shape)


def inverse_dense(
    A: torch.Tensor, G: torch.Tensor, grad: torch.Tensor, damping: float
) -> torch.Tensor:
    """((A + γI)⁻¹ ⊗ (G + γI)⁻¹) vec(∇W)."""
    ia = torch.linalg.inv(A + damping * torch.eye(A.shape[0], dtype=A.dtype))
    ig = torch.linalg.inv(G + damping * torch.eye(G.shape[0], dtype=G.dtype))
    return unvec(torch.kron(ia, ig) @ vec(grad), *grad.shape)
