"""Stages 1 and 2 of ``step()``: the curvature estimate and its decompositions (TPDS Algorithm 1, steps 1-2).

Stage 1 (factors): each layer's batch factors are normalised, averaged across ranks (reduction started from
the gradient hooks as soon as a layer's factors are final, finished in ``step()``) and folded into the
running averages. Stage 2 (second order): each rank decomposes the factors it owns with the second-order
method chosen at construction, then every part is broadcast inside the layer's block of gradient workers.

A layer is *ready* once every part it needs has been computed (host state that all ranks agree on); until
then it keeps its plain gradient: a layer that has not run yet (LayerDrop, a conditional branch, a weight
used functionally) is checked again at every decomposition step, and so is a layer whose first
decomposition failed even in float64.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from .comm import Communicator, StepReduction
from .groups import fold_running, stack
from .log import WarnOnce, logger
from .options import Factor, FactorScaling
from .second_order import Result, SecondOrderMethod, expected_seconds
from .state import LayerState
from .timing import Stage, StageTimer

_NOT_RUN, _FAILED = 1, 2  # why a rank cannot provide a layer's part (the larger wins across ranks)
_Job = tuple[LayerState, Factor, torch.Tensor]  # a factor this rank decomposes
#: Expected seconds from which a decomposition step is announced in the log first.
LONG_DECOMPOSITION_S = 10.0


class Curvature:
    """Factors and second-order parts of the registered ``layers`` on this rank."""

    def __init__(
        self,
        layers: dict[str, LayerState],
        comm: Communicator,
        method: SecondOrderMethod,
        *,
        scaling: FactorScaling,
        timer: StageTimer,
        warn: WarnOnce,
    ) -> None:
        self.layers = layers
        self.comm = comm
        self.method = method
        self.scaling = scaling
        self.timer = timer
        self.warn = warn
        self._step_reduction: StepReduction | None = None
        self._announced = False
        #: Non-finite batch factors skipped since the last check, per group of layers (:mod:`.groups`).
        self._flags: dict[tuple[str, ...], torch.Tensor] = {}
        #: ``'expand'``'s loss terms of the running step on this rank (set by the preconditioner to
        #: :attr:`.capture.Capture.step_terms`).
        self.step_terms: Callable[[], int] = lambda: 0

    # ------------------------------------------------------------------ stage 1: factors
    def factors_final(self, layer: LayerState) -> None:
        """A layer's batch factors are final for this step: start reducing them while backward goes on."""
        if not self.comm.distributed:
            return
        if self._step_reduction is None:
            self._step_reduction = self._start_reduction()
        for kind, acc in ((Factor.G, layer.g_batch), (Factor.A, layer.a_batch)):
            count = acc.count
            f = acc.pop(self.scaling, kind is Factor.G, self._count(layer, kind))
            if f is not None:
                self._step_reduction.add(f"{layer.name}/{kind}", f, count)

    def _by_terms(self, layer: LayerState) -> bool:
        """Whether the layer's G is normalised by the step's loss terms (Linear-type under ``'expand'``)."""
        return self.scaling is FactorScaling.EXPAND and not layer.spatial

    def _count(self, layer: LayerState, kind: Factor) -> int | None:
        """The count G is normalised with where it is not the layer's own: ``'expand'``'s ``L`` summed over
        every backward pass of the step, also those the layer sat out (an MoE expert no token reached in
        one micro-batch is still a layer of that micro-batch's loss)."""
        if kind is Factor.G and self._by_terms(layer):
            return self.step_terms() or None
        return None

    def _start_reduction(self) -> StepReduction:
        by_terms = frozenset(f"{n}/{Factor.G}" for n, s in self.layers.items() if self._by_terms(s))
        return self.comm.start_reduction(by_terms, self.step_terms())

    def reduction_bytes(self) -> tuple[int, int]:
        """Bytes of this step's reduction: batch factors handed to it and not yet packed (their bucket is
        incomplete), and the flat buffers of the buckets in flight (launched from the hooks, not finished)."""
        r = self._step_reduction
        return (0, 0) if r is None else (r.waiting_bytes(), r.inflight_bytes())

    def update_factors(self, decay: float) -> None:
        """Batch factors of this step -> averaged across ranks -> folded into the running averages."""
        reduction, self._step_reduction = self._step_reduction, None
        reduction = reduction or self._start_reduction()
        with self.timer(Stage.FACTOR):
            scales = self._hand_over(reduction)
        with self.timer(Stage.FACTOR_COMM):
            reduced = reduction.finish()
        with self.timer(Stage.FACTOR):
            self._update_running_factors(reduced, decay, scales)

    def _hand_over(self, reduction: StepReduction) -> dict[str, float]:
        """Give ``reduction`` the batch factors the hooks did not hand over (keyed ``"<layer>/a"``); only
        the reduction keeps them, so packing a bucket frees its factors. Distributed, they are normalised
        first; in one process they stay sums and the returned scales normalise them, many in one op."""
        scales: dict[str, float] = {}
        for name, layer in self.layers.items():
            for kind, acc in ((Factor.A, layer.a_batch), (Factor.G, layer.g_batch)):
                count, n = acc.count, self._count(layer, kind)
                if self.comm.distributed:
                    f = acc.pop(self.scaling, kind is Factor.G, n)
                else:
                    popped = acc.pop_unscaled(self.scaling, kind is Factor.G, n)
                    f = None if popped is None else popped[0]
                    if popped is not None:
                        scales[f"{name}/{kind}"] = popped[1]
                if f is not None:
                    reduction.hold(f"{name}/{kind}", f, count)
        return scales

    def _update_running_factors(
        self, batch: dict[str, torch.Tensor], decay: float, scales: dict[str, float]
    ) -> None:
        """Fold ``batch`` (consumed: a bucket's buffer is freed once its last factor is folded in), times
        ``scales`` where given, into the running factors: same-shaped factors together
        (:func:`~.groups.fold_running`)."""
        groups: dict[tuple[object, ...], list[tuple[LayerState, str, torch.Tensor, float]]] = {}
        for name, layer in self.layers.items():
            for kind in Factor:
                key = f"{name}/{kind}"
                f = batch.pop(key, None)
                if f is None:
                    continue
                shape = (kind, tuple(f.shape), f.dtype, f.device)
                groups.setdefault(shape, []).append(
                    (layer, f"{kind}_factor", f, scales.get(key, 1.0))
                )
        for members in groups.values():
            fold_running(members, decay, self._flags)

    # ------------------------------------------------------------------ stage 2: second order
    def update_second_order(self, damping: float) -> None:
        """Decompose (or invert) the factors this rank owns, agree on which layers are ready, and send each
        part to the layer's other gradient workers. A failed decomposition keeps the last good one."""
        with self.timer(Stage.DECOMPOSITION):
            self._warn_nonfinite_factors()
            jobs, missing = self._owned_factors()
            self._announce(jobs)
            decompose_stacked = getattr(self.method, "decompose_stacked", None)
            groups = self._same_shaped(jobs) if decompose_stacked is not None else []
            # One batched decomposition per shape (a group of one included); what failed, and every
            # factor of a method without stacks, goes one by one with float64 retries.
            stacks: list[Result | None] = []
            for idx in groups:  # a loop, not a comprehension: no frame of its own
                stacks.append(decompose_stacked(stack([jobs[i][2] for i in idx])))  # type: ignore[misc]
            results, alone = self._unstacked(jobs, groups, stacks)
            single = self.method.decompose(
                [jobs[i][2] for i in alone],
                damping,
                False,
                previous=[jobs[i][0].parts.get(jobs[i][1]) for i in alone],
                spatial=[jobs[i][0].spatial for i in alone],
            )
            for i, res in zip(alone, single):
                results[i] = res
            self._keep(jobs, results, missing)
            self._derive(damping)
        with self.timer(Stage.DECOMPOSITION_COMM):
            self._agree_ready(missing)
            self.broadcast()

    @staticmethod
    def _same_shaped(jobs: list[_Job]) -> list[list[int]]:
        """The jobs' indices grouped by (factor kind, shape, dtype, device): each group is one batched
        decomposition (:mod:`.groups` stacks the running factors themselves)."""
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (_, kind, f) in enumerate(jobs):
            groups.setdefault((kind, tuple(f.shape), f.dtype, f.device), []).append(i)
        return list(groups.values())

    @staticmethod
    def _unstacked(
        jobs: list[_Job], groups: list[list[int]], stacks: list[Result | None]
    ) -> tuple[list[Result | None], list[int]]:
        """Each job's part from its group's stacked result where that is finite (checked for every group
        with one host synchronisation), and the jobs left to the one-by-one path: those of no group, of a
        group whose batched call raised, and those whose result is not finite."""
        results: list[Result | None] = [None] * len(jobs)
        grouped = {i for idx in groups for i in idx}
        alone = [i for i in range(len(jobs)) if i not in grouped]
        done = []
        for idx, res in zip(groups, stacks):
            if res is None:
                alone += idx
                continue
            total = torch.stack([v.sum(dim=tuple(range(1, v.dim()))) for v in res.values()]).sum(0)
            done.append((idx, res, (total - total).eq(0)))  # NaN or inf anywhere: not 0
        finite = torch.cat([ok for *_, ok in done]).tolist() if done else []
        flags = iter(finite)  # the one host synchronisation
        for idx, res, _ in done:
            for j, i in enumerate(idx):
                if next(flags):
                    results[i] = {k: v[j] for k, v in res.items()}
                else:
                    alone.append(i)
        return results, alone

    def _announce(self, jobs: list[_Job]) -> None:
        """Before a decomposition step expected to take over ``LONG_DECOMPOSITION_S`` (the method's cost
        model, :func:`~.second_order.expected_seconds`): one log line, the first time, so a long silence
        is not taken for a hang."""
        if self._announced or not jobs:
            return
        cost = sum(
            self.method.decomposition_cost(f.shape[0], layer.spatial) for layer, _, f in jobs
        )
        cuda = any(f.is_cuda for _, _, f in jobs)
        seconds = expected_seconds(cost, cuda, torch.get_num_threads())
        if seconds < LONG_DECOMPOSITION_S:
            return
        self._announced = True
        largest = max(f.shape[0] for _, _, f in jobs)
        logger.info(
            "K-FAC: decomposing %d factors on this rank (largest %d²) on %s: expected to take about %.0f s "
            "(every inv_update_steps steps)",
            len(jobs),
            largest,
            "CUDA" if cuda else f"{torch.get_num_threads()} CPU threads",
            seconds,
        )

    def _owned_factors(self) -> tuple[list[_Job], dict[str, int]]:
        """The ``(layer, kind, factor)`` this rank decomposes, and the layers it lacks a factor of
        (``_NOT_RUN``: the layer has not run yet)."""
        jobs: list[_Job] = []
        missing: dict[str, int] = {}
        for layer in self.layers.values():
            for kind in Factor:
                if not self.owns(layer, kind):
                    continue
                factor = getattr(layer, f"{kind}_factor")
                if factor is None:
                    missing[layer.name] = _NOT_RUN
                else:
                    jobs.append((layer, kind, factor))
        return jobs, missing

    def _keep(
        self,
        jobs: list[_Job],
        results: list[Result | None],
        missing: dict[str, int],
    ) -> None:
        """Store each result as its layer's part; a failure keeps the last good part, or marks the layer
        ``_FAILED`` in ``missing`` when there is none."""
        for (layer, kind, _), res in zip(jobs, results):
            if res is not None:
                layer.parts[kind] = res
                continue
            kept = kind in layer.parts
            if not kept:
                missing[layer.name] = _FAILED
            self.warn(
                f"decomp:{layer.name}/{kind}",
                "K-FAC: decomposition of factor %s of layer '%s' failed even in float64; %s",
                kind.upper(),
                layer.name,
                "keeping the last good one"
                if kept
                else "no earlier one to fall back on: its gradient stays plain until one succeeds",
            )

    def _derive(self, damping: float) -> None:
        """The method's derived parts of each layer whose G this rank owns (same-shaped layers together
        where the method has a stacked form)."""
        if not self.method.derived:
            return
        stacked = getattr(self.method, "derive_stacked", None)
        groups: dict[tuple[object, ...], list[LayerState]] = {}
        for layer in self.layers.values():
            a, g = layer.parts.get(Factor.A), layer.parts.get(Factor.G)
            if a is not None and g is not None and self.owns(layer, Factor.G):
                if stacked is None:
                    layer.parts.update(self.method.derive(a, g, damping))
                    continue
                key = tuple(
                    (k, tuple(v.shape), v.dtype, v.device) for r in (a, g) for k, v in r.items()
                )
                groups.setdefault(key, []).append(layer)
        assert stacked is not None or not groups
        for members in groups.values():
            parts = [
                {k: stack([m.parts[kind][k] for m in members]) for k in members[0].parts[kind]}
                for kind in (Factor.A, Factor.G)
            ]
            derived = stacked(parts[0], parts[1], damping)  # type: ignore[misc]
            for i, m in enumerate(members):
                m.parts.update({p: {k: v[i] for k, v in r.items()} for p, r in derived.items()})

    def _agree_ready(self, missing: dict[str, int]) -> None:
        """Every rank learns which layers have all their parts: one small all-reduce, and only while some
        layer is not ready yet (a ready layer stays ready: its owners keep the last good parts)."""
        pending = [layer for layer in self.layers.values() if not layer.ready]
        if not pending:
            return
        flags = torch.tensor(
            [float(missing.get(layer.name, 0)) for layer in pending], device=self.comm.device
        )
        self.comm.all_reduce_max(flags, "decomposition_status")
        for layer, flag in zip(pending, flags.tolist()):
            layer.ready = flag == 0
            layer.not_ready_reason = (
                None
                if layer.ready
                else ("did_not_run" if flag == _NOT_RUN else "decomposition_failed")
            )
            if missing.get(layer.name) == _NOT_RUN:  # logged by the rank that lacks the factor
                why = (
                    "used functionally? a skipped branch?"
                    if layer.module.training
                    else "it is in eval() mode, whose forwards are not recorded"
                )
                self.warn(
                    f"not_run:{layer.name}",
                    "K-FAC: layer '%s' has not run through its module (%s); it keeps its plain gradient "
                    "until it does, checked at every decomposition. Silence this with skip_layers=[%r].",
                    layer.name,
                    why,
                    "^" + re.escape(layer.name) + "$",
                )

    def owns(self, layer: LayerState, part: str) -> bool:
        """Whether this rank computes ``part`` of the layer (derived parts: the G owner)."""
        work = layer.work
        assert work is not None
        return (work.a_owner if part == Factor.A else work.g_owner) == self.comm.rank

    def broadcast(self) -> None:
        """Send each part from the rank that computed it to the other gradient workers of its block."""
        if not self.comm.distributed:
            return
        works = []
        for layer in self.layers.values():
            work = layer.work
            assert work is not None
            if (
                not layer.ready
                or self.comm.rank not in work.grad_workers
                or len(work.grad_workers) == 1
            ):
                continue
            for part in (*Factor, *self.method.derived):
                res = layer.parts.get(part)
                if res is None:
                    res = self.method.empty(
                        part, work.a_dim, work.g_dim, layer.device, layer.spatial
                    )
                elif not all(v.is_contiguous() for v in res.values()):
                    # LAPACK returns column-major eigenvectors and collectives send storage order: an owner
                    # sends (and every receiver holds) row-major copies. Only distributed runs pay for it.
                    res = {k: v.contiguous() for k, v in res.items()}
                layer.parts[part] = res
                src = work.a_owner if part == Factor.A else work.g_owner
                tensors = [res[k] for k in sorted(res)]  # one order on every rank
                works += self.comm.broadcast_in_block(tensors, src, work.grad_workers)
        for w in works:
            w.wait()

    def _warn_nonfinite_factors(self) -> None:
        """One host sync for all layers: name the ones that had a non-finite batch factor skipped."""
        flags, self._flags = self._flags, {}
        if not flags:
            return
        names = [n.rsplit("/", 1)[0] for group in flags for n in group]
        values = torch.cat([f.reshape(-1) for f in flags.values()]).tolist()
        for name, bad in zip(names, values):
            if bad:
                self.warn(
                    f"nonfinite:{name}",
                    "K-FAC: a non-finite batch factor of layer '%s' was skipped (running factors kept)",
                    name,
                )
