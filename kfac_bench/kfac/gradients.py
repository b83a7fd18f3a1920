"""Stages 3 and 4 of ``step()``: precondition the layers' gradients, then KL-clip and write them back
(TPDS Algorithm 1, steps 3-4).

Stage 3 (precondition): each ready layer's ``[W b]`` gradient matrix is preconditioned by its gradient
workers with the second-order method chosen at construction, then broadcast to the other ranks of its
receiver group. Stage 4 (KL clip, write): every preconditioned gradient is scaled by one factor ν (TPDS eq.
16) and written into ``.grad``. Layers that are not ready, and parameters outside K-FAC layers, keep their
plain gradients.

Layers of one shape go together (:mod:`.groups`): their gradients are gathered into one ``(B, g_dim, a_dim)``
stack by one multi-tensor copy for the whole model, preconditioned by the method's batched form where it has
one (``precondition_stacked``: four batched GEMMs per group, on the stacked decompositions), KL-clipped
with one inner product per group, and written back by one multi-tensor copy and one multi-tensor scaling.
A handler takes part through ``grad_blocks`` (:class:`~.layers.base.WeightBiasHandler`); one without it is
gathered and written layer by layer with its own ``grad``/``set_grad``.
"""

from __future__ import annotations

import torch

from .comm import Communicator
from .groups import stack
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
        # This step's groups: the layers of one shape (the same on every rank) and their stacked gradients.
        self._raw: list[tuple[list[str], torch.Tensor]] = []

    # ------------------------------------------------------------------ stage 3: precondition
    def raw(self, skip: set[str]) -> dict[str, torch.Tensor]:
        """The ``[W b]`` gradient matrix of each ready layer with a gradient (the others, and ``skip``:
        layers whose ``requires_grad`` changed, stay plain), as views of one stack per shape group."""
        with self.timer(Stage.PRECONDITION):
            pieces: dict[
                tuple[torch.dtype, torch.device, int, int],
                list[tuple[str, list[tuple[torch.Tensor | None, int, int]]]],
            ] = {}
            for name, layer in self.layers.items():
                if not layer.ready or name in skip or layer.left_out is not None:
                    continue
                blocks = _blocks(layer)
                if blocks is None:
                    continue
                ref = next(m for m, _, _ in blocks if m is not None)
                assert layer.work is not None
                key = (ref.dtype, ref.device, layer.g_dim, layer.a_dim)
                pieces.setdefault(key, []).append((name, blocks))
            self._raw, dsts, srcs, out = [], [], [], {}
            for (dtype, device, g_dim, a_dim), members in pieces.items():
                buf = torch.empty(len(members), g_dim, a_dim, dtype=dtype, device=device)
                for i, (name, blocks) in enumerate(members):
                    for m, c0, c1 in blocks:
                        if m is None:
                            buf[i, :, c0:c1].zero_()
                        else:
                            dsts.append(buf[i, :, c0:c1])
                            srcs.append(m)
                    out[name] = buf[i]
                self._raw.append(([n for n, _ in members], buf))
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        return out

    def precondition(self, raw: dict[str, torch.Tensor], damping: float) -> dict[str, torch.Tensor]:
        """Preconditioned gradients on the gradient workers, then broadcast to the other ranks."""
        stacked = getattr(self.method, "precondition_stacked", None)
        with self.timer(Stage.PRECONDITION):
            grads: dict[str, torch.Tensor] = {}
            for names, buf in self._raw:
                layers = [self.layers[n] for n in names]
                workers = [self.comm.rank in m.work.grad_workers for m in layers]  # type: ignore[union-attr]
                if stacked is not None and all(workers):
                    parts = {
                        p: {k: stack([m.parts[p][k] for m in layers]) for k in layers[0].parts[p]}
                        for p in layers[0].parts
                    }
                    result = stacked(buf, parts, damping)
                    grads.update((n, result[i]) for i, n in enumerate(names))
                    continue
                receive = torch.empty_like(buf) if not all(workers) else None
                for i, (n, m, mine) in enumerate(zip(names, layers, workers)):
                    if mine:
                        grads[n] = self.method.precondition(raw[n], m.parts, damping)
                    else:  # a receive buffer for the broadcast
                        assert receive is not None
                        grads[n] = receive[i]
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
            nu = _kl_clip_scale(grads, self._raw, kl_clip, lr, step)
            self._raw = []  # the stacks live only through the step
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            for name, pg in grads.items():
                layer = self.layers[name]
                handler = layer.handler
                blocks = None
                if isinstance(handler, WeightBiasHandler) and (
                    type(handler).set_grad is WeightBiasHandler.set_grad
                ):
                    blocks = handler.grad_blocks(layer.module, layer.bias, create=True)
                if blocks is not None:
                    for m, c0, c1 in blocks:
                        assert m is not None
                        dsts.append(m)
                        srcs.append(pg[:, c0:c1])
                    continue
                if (
                    nu is not None
                ):  # in place: ``pg`` is this step's own buffer (a result or a receive buffer)
                    pg.mul_(nu if nu.dtype == pg.dtype else nu.to(pg.dtype))
                handler.set_grad(layer.module, pg, layer.bias)
            if dsts:
                torch._foreach_copy_(dsts, srcs)
                if nu is not None:
                    torch._foreach_mul_(dsts, nu)


def _blocks(layer: LayerState) -> list[tuple[torch.Tensor | None, int, int]] | None:
    """The layer's gradient as column blocks (its handler's ``grad_blocks``, else its whole ``grad``),
    None without a gradient; a gradient whose shape does not match the factors raises."""
    handler = layer.handler
    fn = getattr(handler, "grad_blocks", None)
    blocks = fn(layer.module, layer.bias) if fn is not None else None
    if blocks is None:
        grad = handler.grad(layer.module, layer.bias)
        if grad is None:
            return None
        blocks = [(grad, 0, grad.shape[1])]
    width = max(c1 for _, _, c1 in blocks)
    rows = {m.shape[0] for m, _, _ in blocks if m is not None}
    if width != layer.a_dim or rows != {layer.g_dim}:
        shape = (next(iter(rows)), width)
        raise RuntimeError(
            f"K-FAC layer '{layer.name}' ({type(layer.module).__name__}): its gradient matrix is "
            f"{shape}, its factors ({layer.g_dim}, {layer.a_dim}); were its "
            "parameters replaced after the preconditioner was built?"
        )
    return blocks


def _kl_clip_scale(
    grads: dict[str, torch.Tensor],
    groups: list[tuple[list[str], torch.Tensor]],
    kl_clip: Scheduled[float] | None,
    lr: Scheduled[float],
    step: int,
) -> torch.Tensor | None:
    """ν = min(1, sqrt(κ / |Σ_layers lr²·⟨∇̃W, ∇W⟩|)) as a device scalar: no host synchronisation. One
    inner product per group of same-shaped layers (the stacks of the raw and preconditioned gradients),
    grouped alike on every rank, so every rank computes the same ν."""
    if kl_clip is None or not grads:
        return None
    kappa = resolve(kl_clip, step)
    rate = resolve(lr, step)
    inner = [_inner(stack([grads[n] for n in names]), raw) for names, raw in groups]
    vg = torch.stack(inner).sum() * rate**2
    # |vg| = 0 gives sqrt(inf) -> clamped to 1: no scaling, as the reference does.
    return torch.sqrt(kappa / vg.abs()).clamp(max=1.0)


def _inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``⟨a, b⟩`` as a float64 scalar: one dot product without a temporary for float32/float64 matrices
    (BLAS accumulates in the input precision), else summed in float64."""
    if a.dtype == b.dtype and a.dtype in (torch.float32, torch.float64):
        return torch.vdot(a.reshape(-1), b.reshape(-1)).to(torch.float64)
    return (a * b).sum(dtype=torch.float64)
