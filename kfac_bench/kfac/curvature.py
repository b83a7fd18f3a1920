"""Stages 1 and 2 of ``step()``: the curvature estimate and its decompositions (TPDS Algorithm 1, steps 1-2).

Stage 1 (factors): each layer's batch factors are normalised, averaged across ranks (reduction started from
the gradient hooks as soon as a layer's factors are final, finished in ``step()``) and folded into the
running averages. Stage 2 (second order): each rank decomposes the factors it owns with the second-order
method chosen at construction, then every part is broadcast inside the layer's block of gradient workers.
"""

from __future__ import annotations

import re

import torch

from .comm import Communicator, StepReduction
from .factors import running_average
from .log import WarnOnce, logger
from .options import FactorReduction, FactorScaling
from .second_order import SecondOrderMethod
from .state import LayerState
from .timing import StageTimer

Batch = list[tuple[str, torch.Tensor, int | None]]  # (key "<layer>/a", factor, reduction target)


class Curvature:
    """Factors and second-order parts of the registered ``layers`` on this rank."""

    def __init__(
        self,
        layers: dict[str, LayerState],
        comm: Communicator,
        method: SecondOrderMethod,
        *,
        scaling: FactorScaling,
        reduction: FactorReduction,
        timer: StageTimer,
        warn: WarnOnce,
    ) -> None:
        self.layers = layers
        self.comm = comm
        self.method = method
        self.scaling = scaling
        self.reduction = reduction
        self.timer = timer
        self.warn = warn
        self.has_decompositions = False
        self._step_reduction: StepReduction | None = None

    # ------------------------------------------------------------------ stage 1: factors
    def factors_final(self, layer: LayerState) -> None:
        """A layer's batch factors are final for this step: start reducing them while backward goes on."""
        if not self.comm.distributed:
            return
        if self._step_reduction is None:
            self._step_reduction = self.comm.start_reduction()
        for kind, acc, is_g in (("g", layer.g_batch, True), ("a", layer.a_batch, False)):
            f = acc.pop(self.scaling, is_g)
            if f is not None:
                self._step_reduction.add(f"{layer.name}/{kind}", f)

    def update_factors(self, decay: float) -> None:
        """Batch factors of this step -> averaged across ranks -> folded into the running averages."""
        with self.timer("factor"):
            local = self._batch_factors()
        with self.timer("factor_comm"):
            reduction, self._step_reduction = self._step_reduction, None
            reduced = (reduction or self.comm.start_reduction()).finish(local)
        with self.timer("factor"):
            self._update_running_factors(reduced, decay)

    def _batch_factors(self) -> Batch:
        """Normalised batch factors of this step, keyed ``"<layer>/a"``, with their reduction target."""
        items: Batch = []
        reduce = self.reduction is FactorReduction.REDUCE
        for name, layer in self.layers.items():
            assert layer.work is not None
            for kind, acc, owner, is_g in (
                ("a", layer.a_batch, layer.work.a_owner, False),
                ("g", layer.g_batch, layer.work.g_owner, True),
            ):
                f = acc.pop(self.scaling, is_g)
                if f is not None:
                    items.append((f"{name}/{kind}", f, owner if reduce else None))
        return items

    def _update_running_factors(self, batch: dict[str, torch.Tensor], decay: float) -> None:
        for name, layer in self.layers.items():
            for kind in ("a", "g"):
                f = batch.get(f"{name}/{kind}")
                if f is None:
                    continue
                attr = f"{kind}_factor"
                setattr(layer, attr, running_average(getattr(layer, attr), f, decay))
                bad = ~torch.isfinite(f).all()
                layer.nonfinite = bad if layer.nonfinite is None else layer.nonfinite | bad

    # ------------------------------------------------------------------ stage 2: second order
    def update_second_order(self, damping: float) -> bool:
        """Decompose the factors this rank owns, then send each part to the layer's other gradient workers.

        Returns whether layers were dropped (the placement must then be recomputed).
        """
        dropped = self._exclude_silent_layers()
        with self.timer("decomposition"):
            self.decompose(damping)
        with self.timer("decomposition_comm"):
            self.broadcast()
        self.has_decompositions = True
        return dropped

    def _exclude_silent_layers(self) -> bool:
        """Drop layers whose hooks never fired (e.g. ``MultiheadAttention.out_proj``, used functionally)."""
        silent = [n for n, s in self.layers.items() if not (s.seen_a and s.seen_g)]
        for name in silent:
            logger.warning(
                "K-FAC: layer '%s' never ran its forward/backward through the module (its weight is used "
                "functionally?); it keeps its plain gradient. Silence this with skip_layers=[%r].",
                name,
                "^" + re.escape(name) + "$",
            )
            self.layers.pop(name).remove_hooks()
        return bool(silent)

    def decompose(self, damping: float) -> None:
        """Decompose (or invert) the factors this rank owns; keep the last good result on failure."""
        self._warn_nonfinite_factors()
        jobs: list[tuple[LayerState, str, torch.Tensor]] = []
        for layer in self.layers.values():
            for kind in ("a", "g"):
                factor = getattr(layer, f"{kind}_factor")
                if self.owns(layer, kind) and factor is not None:
                    jobs.append((layer, kind, factor))
        batch = self.comm.world_size == 1 and any(f.is_cuda for _, _, f in jobs)
        results = self.method.decompose([f for _, _, f in jobs], damping, batch)
        for (layer, kind, _), res in zip(jobs, results):
            if res is None:
                self.warn(
                    f"decomp:{layer.name}/{kind}",
                    "K-FAC: decomposition of factor %s of layer '%s' failed even in float64; keeping the "
                    "last good one",
                    kind.upper(),
                    layer.name,
                )
                continue
            layer.parts[kind] = res
        if not self.method.derived:
            return
        for layer in self.layers.values():
            a, g = layer.parts.get("a"), layer.parts.get("g")
            if a is not None and g is not None and self.owns(layer, "g"):
                layer.parts.update(self.method.derive(a, g, damping))

    def owns(self, layer: LayerState, part: str) -> bool:
        """Whether this rank computes ``part`` of the layer (derived parts: the G owner)."""
        work = layer.work
        assert work is not None
        return (work.a_owner if part == "a" else work.g_owner) == self.comm.rank

    def broadcast(self) -> None:
        """Send each part from the rank that computed it to the other gradient workers of its block."""
        if not self.comm.distributed:
            return
        works = []
        for layer in self.layers.values():
            work = layer.work
            assert work is not None
            if self.comm.rank not in work.grad_workers or len(work.grad_workers) == 1:
                continue
            for part in ("a", "g", *self.method.derived):
                res = layer.parts.get(part)
                if res is None:
                    res = self.method.empty(part, work.a_dim, work.g_dim, layer.device)
                elif not all(v.is_contiguous() for v in res.values()):
                    # LAPACK returns column-major eigenvectors and collectives send storage order: an owner
                    # sends (and every receiver holds) row-major copies. Only distributed runs pay for it.
                    res = {k: v.contiguous() for k, v in res.items()}
                layer.parts[part] = res
                src = work.a_owner if part == "a" else work.g_owner
                tensors = [res[k] for k in sorted(res)]  # one order on every rank
                works += self.comm.broadcast_in_block(tensors, src, work.grad_workers)
        for w in works:
            w.wait()

    def _warn_nonfinite_factors(self) -> None:
        """One host sync for all layers: name the ones that had a non-finite batch factor skipped."""
        flagged = [(n, s) for n, s in self.layers.items() if s.nonfinite is not None]
        if not flagged:
            return
        values = torch.stack([s.nonfinite for _, s in flagged]).tolist()  # type: ignore[misc]
        for (name, layer), bad in zip(flagged, values):
            layer.nonfinite = None
            if bad:
                self.warn(
                    f"nonfinite:{name}",
                    "K-FAC: a non-finite batch factor of layer '%s' was skipped (running factors kept)",
                    name,
                )
