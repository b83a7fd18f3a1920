"""Stages 3 and 4 of ``step()``: precondition the layers' gradients, then KL-clip and write them back
(TPDS Algorithm 1, steps 3-4).

Stage 3 (precondition): each ready layer's ``[W b]`` gradient matrix is preconditioned by its gradient
workers with the second-order method chosen at construction, then broadcast to the other ranks of its
receiver group. Stage 4 (KL clip, write): every preconditioned gradient is scaled by one factor ν (TPDS eq.
16) and written into ``.grad``. Layers that are not ready, and parameters outside K-FAC layers, keep their
plain gradients.
"""

from __future__ import annotations

import torch

from .comm import Communicator
from .layers.base import WeightBiasHandler
from .schedules import Scheduled, resolve
from .second_order import SecondOrderMethod
from .state import LayerState
from .timing import Stage, StageTimer


class Gradients:
    """The preconditioned gradients of the registered ``layers`` on this rank."""

    def __init__(
        self,
        layers: dict[str, LayerState],
        comm: Communicator,
        method: SecondOrderMethod,
        timer: StageTimer,
    ) -> None:
        self.layers = layers
        self.comm = comm
        self.method = method
        self.timer = timer

    # ------------------------------------------------------------------ stage 3: precondition
    def raw(self, skip: set[str]) -> dict[str, torch.Tensor]:
        """The ``[W b]`` gradient matrix of each ready layer with a gradient (the others, and ``skip``:
        layers whose ``requires_grad`` changed, stay plain)."""
        out = {}
        for name, layer in self.layers.items():
            if layer.ready and name not in skip and layer.left_out is None:
                grad = layer.handler.grad(layer.module, layer.bias)
                if grad is not None:
                    if grad.shape != (layer.g_dim, layer.a_dim):
                        raise RuntimeError(
                            f"K-FAC layer '{name}' ({type(layer.module).__name__}): its gradient matrix is "
                            f"{tuple(grad.shape)}, its factors ({layer.g_dim}, {layer.a_dim}); were its "
                            "parameters replaced after the preconditioner was built?"
                        )
                    out[name] = grad
        return out

    def precondition(self, raw: dict[str, torch.Tensor], damping: float) -> dict[str, torch.Tensor]:
        """Preconditioned gradients on the gradient workers, then broadcast to the other ranks."""
        with self.timer(Stage.PRECONDITION):
            grads = {}
            for name, grad in raw.items():
                layer = self.layers[name]
                assert layer.work is not None
                if self.comm.rank in layer.work.grad_workers:
                    grads[name] = self.method.precondition(grad, layer.parts, damping)
                else:
                    grads[name] = torch.empty_like(grad)  # receive buffer for the broadcast
        with self.timer(Stage.GRAD_BROADCAST):
            works = []
            for name, g in grads.items():
                work = self.layers[name].work
                assert work is not None
                works += self.comm.broadcast_grad(g, work)
            for w in works:
                w.wait()
        return grads

    # ------------------------------------------------------------------ stage 4: KL clip, write
    def clip_and_write(
        self,
        grads: dict[str, torch.Tensor],
        raw: dict[str, torch.Tensor],
        kl_clip: Scheduled[float] | None,
        lr: Scheduled[float],
        step: int,
    ) -> None:
        """Scale by the KL-clip factor ν (TPDS eq. 16) and write the gradients back into ``.grad``."""
        with self.timer(Stage.KL_CLIP):
            nu = _kl_clip_scale(grads, raw, kl_clip, lr, step)
        for name, pg in grads.items():
            layer = self.layers[name]
            handler = layer.handler
            if (
                nu is not None
                and isinstance(handler, WeightBiasHandler)
                and type(handler).set_grad is WeightBiasHandler.set_grad
            ):
                # Linear/Conv2d: scale while writing, one pass over the gradient.
                handler.set_grad(layer.module, pg, layer.bias, scale=nu)
                continue
            if (
                nu is not None
            ):  # in place: ``pg`` is this step's own buffer (a result or a receive buffer)
                pg.mul_(nu if nu.dtype == pg.dtype else nu.to(pg.dtype))
            handler.set_grad(layer.module, pg, layer.bias)


def _kl_clip_scale(
    grads: dict[str, torch.Tensor],
    raw: dict[str, torch.Tensor],
    kl_clip: Scheduled[float] | None,
    lr: Scheduled[float],
    step: int,
) -> torch.Tensor | None:
    """ν = min(1, sqrt(κ / |Σ_layers lr²·⟨∇̃W, ∇W⟩|)) as a device scalar: no host synchronisation."""
    if kl_clip is None or not grads:
        return None
    kappa = resolve(kl_clip, step)
    rate = resolve(lr, step)
    vg = torch.stack([_inner(pg, raw[name]) for name, pg in grads.items()]).sum() * rate**2
    # |vg| = 0 gives sqrt(inf) -> clamped to 1: no scaling, as the reference does.
    return torch.sqrt(kappa / vg.abs()).clamp(max=1.0)


def _inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``⟨a, b⟩`` as a float64 scalar: one dot product without a temporary for float32/float64 matrices
    (BLAS accumulates in the input precision), else summed in float64."""
    if a.dtype == b.dtype and a.dtype in (torch.float32, torch.float64):
        return torch.vdot(a.reshape(-1), b.reshape(-1)).to(torch.float64)
    return (a * b).sum(dtype=torch.float64)
