"""KFACPreconditioner: factors -> second order -> precondition -> KL clip -> write gradients.

Usage (any PyTorch loop; with DDP, after its gradient averaging; with AMP, after ``scaler.unscale_``)::

    precond = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
    loss.backward()
    precond.step()
    optimizer.step()
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from . import assignment as asg
from .comm import Communicator, StepReduction
from .factors import running_average
from .layers import NOT_SUPPORTED, handler_for
from .options import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    FactorScaling,
    Placement,
)
from .schedules import Scheduled, is_due, resolve
from .second_order import Result, eigen, inverse
from .state import LayerState, result_bytes, tensor_bytes

logger = logging.getLogger("kfac_bench.kfac")

STAGES = (
    "factor",
    "factor_comm",
    "decomposition",
    "decomposition_comm",
    "precondition",
    "grad_broadcast",
    "kl_clip",
)


class KFACPreconditioner:
    """Distributed K-FAC preconditioner for the ``nn.Linear`` and ``nn.Conv2d`` layers of a model.

    ``step()`` rewrites the ``.grad`` of every registered layer with its K-FAC preconditioned (and KL-clipped)
    gradient; any optimizer then applies it. Other parameters keep their plain gradients.

    Args:
        model: the model (a ``DistributedDataParallel`` wrapper is unwrapped).
        factor_update_steps: steps between factor updates (PAPER.md §1.2), constant or callable of ``steps``.
        inv_update_steps: steps between decompositions; preconditioning uses the cached ones in between.
        damping: γ (Tikhonov damping), constant or callable.
        factor_decay: running-average decay (keep this share of the old factor), constant or callable.
        kl_clip: κ of the gradient scaling ν = min(1, sqrt(κ / |Σ lr²⟨∇̃W, ∇W⟩|)); None disables it.
        lr: the learning rate used by KL clipping, constant or callable.
        accumulation_steps: micro-batches per optimizer step (each loss divided by this number).
        compute_method: ``'eigen'`` (default, all the paper's results) or ``'inverse'``.
        compute_eigenvalue_outer_product: precompute ``1/(λ_G λ_Aᵀ + γ)`` on decomposition steps (KAISA §4.4);
            needs A and G on the same rank, so it is ignored when ``colocate_factors=False``.
        factor_dtype: dtype of factors (default: float32, or float64 for a float64 model).
        inv_dtype: dtype of decompositions (default: float32, or float64 with float64 factors).
        skip_layers: regexes; a layer is skipped if one matches (``re.search``) its qualified name or its
            class name.
        grad_scaler: a ``torch.amp.GradScaler`` or a callable returning the loss scale; G is unscaled with it.
        factor_scaling: ``'per_example'`` or ``'kaisa'`` (see :mod:`kfac_bench.kfac.factors`).
        grad_worker_fraction: share of ranks that precondition each layer: 1 = COMM-OPT, 1/world = MEM-OPT,
            in between HYBRID-OPT; the strings ``'comm_opt'``, ``'mem_opt'`` and ``'hybrid_opt'`` (= 0.5)
            work too.
        assignment_strategy: cost of a factor for placement, ``'compute'`` (n³) or ``'memory'`` (n²).
        colocate_factors: decompose a layer's A and G on the same rank.
        placement: ``'lpt'`` (KAISA's greedy longest-processing-time) or ``'round_robin'`` (SC20).
        factor_reduction: ``'allreduce'`` (every rank keeps every factor) or ``'reduce'`` (only its owner).
        allreduce_bucket_cap_mb: bucket size of the factor reduction.
        symmetry_aware: communicate only the upper triangle of symmetric factors.
        comm_dtype: dtype of the factor communication (e.g. ``torch.bfloat16``); default: the factor dtype.
        track_stage_times: accumulate wall time per stage (synchronising CUDA around stages), see
            :meth:`stage_times`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Scheduled[int] = 1,
        inv_update_steps: Scheduled[int] = 1,
        damping: Scheduled[float] = 0.001,
        factor_decay: Scheduled[float] = 0.95,
        kl_clip: Scheduled[float] | None = 0.001,
        lr: Scheduled[float] = 0.1,
        accumulation_steps: int = 1,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        skip_layers: Sequence[str] = (),
        grad_scaler: Any = None,
        factor_scaling: FactorScaling | str = FactorScaling.PER_EXAMPLE,
        grad_worker_fraction: float | DistributedStrategy | str = 1.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        placement: Placement | str = Placement.LPT,
        factor_reduction: FactorReduction | str = FactorReduction.ALLREDUCE,
        allreduce_bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
        comm_dtype: torch.dtype | None = None,
        track_stage_times: bool = False,
    ) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.model = model
        self.factor_update_steps = factor_update_steps
        self.inv_update_steps = inv_update_steps
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.accumulation_steps = accumulation_steps
        self.compute_method = ComputeMethod.parse(compute_method)
        self.factor_scaling = FactorScaling.parse(factor_scaling)
        self.colocate_factors = colocate_factors
        self.compute_eigenvalue_outer_product = (
            compute_eigenvalue_outer_product and colocate_factors
        )
        self.skip_layers = [re.compile(p) for p in skip_layers]
        self.grad_scaler = grad_scaler
        self.assignment_strategy = AssignmentStrategy.parse(assignment_strategy)
        self.placement = Placement.parse(placement)
        self.factor_reduction = FactorReduction.parse(factor_reduction)
        self.track_stage_times = track_stage_times
        self.steps = 0

        param = next(model.parameters(), None)
        low = param is None or param.dtype in (torch.float16, torch.bfloat16)
        default = torch.float32 if low or param is None else param.dtype
        self.factor_dtype = factor_dtype or default
        self.inv_dtype = inv_dtype or (
            torch.float64 if self.factor_dtype == torch.float64 else torch.float32
        )

        self.layers: dict[str, LayerState] = {}
        self._micro_batches = 0
        self._reduction: StepReduction | None = None
        self._register(model)
        self.comm = Communicator({}, allreduce_bucket_cap_mb, symmetry_aware, comm_dtype)
        self.grad_worker_fraction = _fraction(grad_worker_fraction, self.comm.world_size)
        self._plan()
        self._collecting = is_due(self.factor_update_steps, 0)
        self._stage_seconds = dict.fromkeys(STAGES, 0.0)
        self._warned: set[str] = set()
        self._has_decompositions = False

    # ------------------------------------------------------------------ registration
    def _register(self, model: nn.Module) -> None:
        skipped, unsupported = [], []
        for name, module in model.named_modules():
            handler = handler_for(module)
            if handler is None:
                if isinstance(module, NOT_SUPPORTED):
                    unsupported.append(f"{name} ({type(module).__name__})")
                continue
            if any(p.search(name) or p.search(type(module).__name__) for p in self.skip_layers):
                skipped.append(name)
                continue
            if not module.weight.requires_grad:
                continue
            reason = handler.unsupported_reason(module)
            if reason is not None:
                unsupported.append(f"{name} ({reason})")
                continue
            a_dim = module.weight[0].numel() + (module.bias is not None)
            layer = LayerState(name, module, handler, a_dim, module.weight.shape[0])
            layer.handles.append(module.register_forward_hook(self._forward_hook(layer)))
            self.layers[name] = layer
        self._root_handle = model.register_forward_pre_hook(self._count_micro_batch)
        logger.info(
            "K-FAC preconditions %d layers; skipped by skip_layers: %d%s",
            len(self.layers),
            len(skipped),
            f"; not supported (plain gradient): {', '.join(unsupported)}" if unsupported else "",
        )

    def _plan(self) -> None:
        """(Re)compute the placement of every layer. Deterministic, so every rank agrees unasked."""
        shapes = [asg.LayerShape(n, s.a_dim, s.g_dim) for n, s in self.layers.items()]
        plan = asg.assign(
            shapes,
            self.comm.world_size,
            self.grad_worker_fraction,
            self.assignment_strategy,
            self.colocate_factors,
            self.placement,
        )
        for name, work in plan.items():
            self.layers[name].work = work
        self.comm.set_plan(plan)
        reduce = self.factor_reduction is FactorReduction.REDUCE
        entries = [  # backward order: the last layer's factors are ready first
            (f"{name}/{kind}", dim, owner if reduce else None)
            for name, w in reversed(plan.items())
            for kind, dim, owner in (("g", w.g_dim, w.g_owner), ("a", w.a_dim, w.a_owner))
        ]
        self.comm.plan_buckets(entries, torch.empty((), dtype=self.factor_dtype).element_size())

    # ------------------------------------------------------------------ hooks
    def _count_micro_batch(self, module: nn.Module, args: Any) -> None:
        if self._collecting and torch.is_grad_enabled():
            self._micro_batches += 1

    def _forward_hook(self, layer: LayerState) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not (
                self._collecting and torch.is_grad_enabled() and isinstance(output, torch.Tensor)
            ):
                return
            with self._stage("factor", sync=False):
                gram = layer.handler.a_gram(module, args[0].detach(), self.factor_dtype)
                layer.a_batch.add(gram, self.factor_scaling, False, layer.handler.spatial)
            layer.seen_a = True
            node = output.grad_fn
            if node is not None:
                # A prehook on the node that produced the output sees dL/d(output) even when the output
                # is later modified in place (e.g. an inplace ReLU), unlike a tensor hook.
                node.register_prehook(self._grad_hook(layer, module, output.output_nr))
                layer.pending_g += 1

        return hook

    def _grad_hook(
        self, layer: LayerState, module: nn.Module, index: int
    ) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            g = grad_outputs[index]
            if g is None:
                return
            with self._stage("factor", sync=False):
                gram = layer.handler.g_gram(module, g.detach(), self.factor_dtype)
                scale = self._loss_scale()
                if scale is not None:
                    gram = gram._replace(sum=gram.sum / scale**2)
                layer.g_batch.add(gram, self.factor_scaling, True, layer.handler.spatial)
            layer.seen_g = True
            layer.pending_g -= 1
            if layer.pending_g == 0 and self._micro_batches >= self.accumulation_steps:
                self._layer_factors_ready(layer)

        return hook

    def _layer_factors_ready(self, layer: LayerState) -> None:
        """The layer's batch factors are final for this step: start reducing them while backward goes on."""
        if not self.comm.distributed:
            return
        if self._reduction is None:
            self._reduction = self.comm.start_reduction()
        for kind, acc, is_g in (("g", layer.g_batch, True), ("a", layer.a_batch, False)):
            f = acc.pop(self.factor_scaling, is_g)
            if f is not None:
                self._reduction.add(f"{layer.name}/{kind}", f)

    def _loss_scale(self) -> torch.Tensor | float | None:
        s = self.grad_scaler
        if s is None:
            return None
        if hasattr(s, "is_enabled"):
            if not s.is_enabled():
                return None
            # The scale as a device tensor: reading it as a float would synchronise every backward hook.
            scale_async = getattr(s, "_get_scale_async", None)
            return scale_async() if scale_async is not None else float(s.get_scale())
        return s()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of this step.

        Note:
            Call after ``loss.backward()`` (after DDP's all-reduce and ``GradScaler.unscale_``) and before
            ``optimizer.step()``; once per optimizer step, after all ``accumulation_steps`` micro-batches.
        """
        step = self.steps
        if is_due(self.factor_update_steps, step):
            with self._stage("factor"):
                local = self._batch_factors()
            with self._stage("factor_comm"):
                reduced = self._reduce_factors(local)
            with self._stage("factor"):
                self._update_running_factors(reduced, resolve(self.factor_decay, step))
        if is_due(self.inv_update_steps, step):
            self._exclude_silent_layers()
            with self._stage("decomposition"):
                self._update_second_order(resolve(self.damping, step))
            with self._stage("decomposition_comm"):
                self._broadcast_second_order()
            self._has_decompositions = True
        with self._stage("precondition"):
            raw = self._layer_gradients()
            grads = self._precondition_gradients(raw, resolve(self.damping, step))
        with self._stage("grad_broadcast"):
            self._broadcast_gradients(grads)
        with self._stage("kl_clip"):
            nu = self._kl_clip_scale(grads, raw, step)
        self._write_gradients(grads, nu)
        self.steps += 1
        self._collecting = is_due(self.factor_update_steps, self.steps)
        self._micro_batches = 0

    def _batch_factors(self) -> list[tuple[str, torch.Tensor, int | None]]:
        """Normalised batch factors of this step, keyed ``"<layer>/a"``, with their reduction target."""
        items: list[tuple[str, torch.Tensor, int | None]] = []
        reduce = self.factor_reduction is FactorReduction.REDUCE
        for name, layer in self.layers.items():
            assert layer.work is not None
            for kind, acc, owner, is_g in (
                ("a", layer.a_batch, layer.work.a_owner, False),
                ("g", layer.g_batch, layer.work.g_owner, True),
            ):
                f = acc.pop(self.factor_scaling, is_g)
                if f is not None:
                    items.append((f"{name}/{kind}", f, owner if reduce else None))
        return items

    def _reduce_factors(
        self, items: list[tuple[str, torch.Tensor, int | None]]
    ) -> dict[str, torch.Tensor]:
        reduction, self._reduction = self._reduction, None
        return (reduction or self.comm.start_reduction()).finish(items)

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

    def _exclude_silent_layers(self) -> None:
        """Drop layers whose hooks never fired (e.g. ``MultiheadAttention.out_proj``, used functionally)."""
        silent = [n for n, s in self.layers.items() if not (s.seen_a and s.seen_g)]
        if not silent:
            return
        for name in silent:
            logger.warning(
                "K-FAC: layer '%s' never ran its forward/backward through the module (its weight is used "
                "functionally?); it keeps its plain gradient. Silence this with skip_layers=[%r].",
                name,
                "^" + re.escape(name) + "$",
            )
            self.layers.pop(name).remove_hooks()
        self._plan()

    def _update_second_order(self, damping: float) -> None:
        """Decompose (or invert) the factors this rank owns; keep the last good result on failure."""
        self._warn_nonfinite_factors()
        jobs: list[tuple[LayerState, str, torch.Tensor]] = []
        for layer in self.layers.values():
            work = layer.work
            assert work is not None
            if work.a_owner == self.comm.rank and layer.a_factor is not None:
                jobs.append((layer, "a", layer.a_factor))
            if work.g_owner == self.comm.rank and layer.g_factor is not None:
                jobs.append((layer, "g", layer.g_factor))
        batch = self.comm.world_size == 1 and any(f.is_cuda for _, _, f in jobs)
        factors = [f for _, _, f in jobs]
        if self.compute_method is ComputeMethod.EIGEN:
            results = eigen.decompose(factors, self.inv_dtype, batch_equal_sizes=batch)
        else:
            results = inverse.decompose(factors, self.inv_dtype, damping, batch_equal_sizes=batch)
        for (layer, kind, _), res in zip(jobs, results):
            if res is None:
                self._warn_once(
                    f"decomp:{layer.name}/{kind}",
                    "K-FAC: decomposition of factor %s of layer '%s' failed even in float64; keeping the "
                    "last good one",
                    kind.upper(),
                    layer.name,
                )
                continue
            setattr(layer, f"{kind}_decomp", res)
        if self._uses_outer:
            for layer in self.layers.values():
                if (
                    layer.a_decomp is not None
                    and layer.g_decomp is not None
                    and self._owns_g(layer)
                ):
                    layer.outer = eigen.inverse_outer(layer.a_decomp, layer.g_decomp, damping)

    def _owns_g(self, layer: LayerState) -> bool:
        return layer.work is not None and layer.work.g_owner == self.comm.rank

    def _broadcast_second_order(self) -> None:
        """Send each decomposition from its owner to the other gradient workers of its block."""
        if not self.comm.distributed:
            return
        works = []
        for layer in self.layers.values():
            work = layer.work
            assert work is not None
            if self.comm.rank not in work.grad_workers or len(work.grad_workers) == 1:
                continue
            for kind, owner in (("a", work.a_owner), ("g", work.g_owner)):
                res = self._ensure_result(layer, kind)
                works += self.comm.broadcast_in_block(list(res.values()), owner, work.grad_workers)
            if self._uses_outer:
                if layer.outer is None:
                    layer.outer = self._empty_result(layer, "outer")["outer"]
                works += self.comm.broadcast_in_block(
                    [layer.outer], work.g_owner, work.grad_workers
                )
        for w in works:
            w.wait()

    def _ensure_result(self, layer: LayerState, kind: str) -> Result:
        """This layer's ``kind`` decomposition, allocating receive buffers where this rank has none."""
        res: Result | None = getattr(layer, f"{kind}_decomp")
        if res is None:
            res = self._empty_result(layer, kind)
        elif not all(v.is_contiguous() for v in res.values()):
            # LAPACK returns column-major eigenvectors and collectives send storage order: an owner sends
            # (and every receiver holds) row-major copies. Only distributed runs pay for the copy.
            res = {k: v.contiguous() for k, v in res.items()}
        setattr(layer, f"{kind}_decomp", res)
        return res

    def _empty_result(self, layer: LayerState, kind: str) -> Result:
        """Uninitialised tensors shaped like a ``kind`` ('a', 'g' or 'outer') result, to receive into."""
        work = layer.work
        assert work is not None
        dev, dt = self._device(layer), self.inv_dtype
        if kind == "outer":
            return {"outer": torch.empty(work.g_dim, work.a_dim, dtype=dt, device=dev)}
        dim = work.a_dim if kind == "a" else work.g_dim
        if self.compute_method is ComputeMethod.EIGEN:
            return {
                "q": torch.empty(dim, dim, dtype=dt, device=dev),
                "eigenvalues": torch.empty(dim, dtype=dt, device=dev),
            }
        return {"inverse": torch.empty(dim, dim, dtype=dt, device=dev)}

    @property
    def _uses_outer(self) -> bool:
        return self.compute_eigenvalue_outer_product and self.compute_method is ComputeMethod.EIGEN

    def _device(self, layer: LayerState) -> torch.device:
        w = layer.module.weight
        assert isinstance(w, torch.Tensor)
        return w.device

    def _layer_gradients(self) -> dict[str, torch.Tensor]:
        """Each registered layer's ``[W b]`` gradient matrix (layers without a gradient are absent)."""
        if not self._has_decompositions:
            return {}
        out = {}
        for name, layer in self.layers.items():
            grad = layer.handler.grad(layer.module)
            if grad is not None:
                out[name] = grad
        return out

    def _precondition_gradients(
        self, raw: dict[str, torch.Tensor], damping: float
    ) -> dict[str, torch.Tensor]:
        """Preconditioned gradients: computed where this rank is a gradient worker, else receive buffers."""
        out = {}
        for name, grad in raw.items():
            layer = self.layers[name]
            work = layer.work
            assert work is not None
            if self.comm.rank not in work.grad_workers:
                out[name] = torch.empty_like(grad)  # receive buffer for the gradient broadcast
                continue
            if self.compute_method is ComputeMethod.EIGEN:
                assert layer.a_decomp is not None and layer.g_decomp is not None
                out[name] = eigen.precondition(
                    grad, layer.a_decomp, layer.g_decomp, damping, layer.outer
                )
            else:
                assert layer.a_decomp is not None and layer.g_decomp is not None
                out[name] = inverse.precondition(grad, layer.a_decomp, layer.g_decomp)
        return out

    def _broadcast_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        works = []
        for name, g in grads.items():
            work = self.layers[name].work
            assert work is not None
            works += self.comm.broadcast_grad(g, work)
        for w in works:
            w.wait()

    def _kl_clip_scale(
        self, grads: dict[str, torch.Tensor], raw: dict[str, torch.Tensor], step: int
    ) -> torch.Tensor | None:
        """ν = min(1, sqrt(κ / |Σ_layers lr²·⟨∇̃W, ∇W⟩|)) as a device scalar: no host synchronisation."""
        if self.kl_clip is None or not grads:
            return None
        kappa = resolve(self.kl_clip, step)
        lr = resolve(self.lr, step)
        vg = torch.zeros((), dtype=torch.float64, device=next(iter(grads.values())).device)
        for name, pg in grads.items():
            vg += (pg * raw[name]).sum(dtype=torch.float64)
        vg = vg * lr**2
        # |vg| = 0 gives sqrt(inf) -> clamped to 1: no scaling, as the reference does.
        return torch.sqrt(kappa / vg.abs()).clamp(max=1.0)

    def _write_gradients(self, grads: dict[str, torch.Tensor], nu: torch.Tensor | None) -> None:
        for name, pg in grads.items():
            layer = self.layers[name]
            if nu is not None:
                pg = pg * nu.to(pg.dtype)
            layer.handler.set_grad(layer.module, pg)

    # ------------------------------------------------------------------ robustness helpers
    def _warn_nonfinite_factors(self) -> None:
        """One host sync for all layers: name the ones that had a non-finite batch factor skipped."""
        flagged = [(n, s) for n, s in self.layers.items() if s.nonfinite is not None]
        if not flagged:
            return
        values = torch.stack([s.nonfinite for _, s in flagged]).tolist()  # type: ignore[misc]
        for (name, layer), bad in zip(flagged, values):
            layer.nonfinite = None
            if bad:
                self._warn_once(
                    f"nonfinite:{name}",
                    "K-FAC: a non-finite batch factor of layer '%s' was skipped (running factors kept)",
                    name,
                )

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    @contextlib.contextmanager
    def _stage(self, name: str, sync: bool = True) -> Iterator[None]:
        """Add the block's wall time to a stage. ``sync=False`` (inside hooks, where synchronising CUDA
        per layer would stall the pipeline) measures host time only, exact on CPU."""
        if not self.track_stage_times:
            yield
            return
        if sync:
            self._sync()
        t0 = time.perf_counter()
        yield
        if sync:
            self._sync()
        self._stage_seconds[name] += time.perf_counter() - t0

    def _sync(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ introspection / lifecycle
    def stage_times(self) -> dict[str, float]:
        """Cumulative seconds per stage since construction (zeros unless ``track_stage_times``).

        ``factor`` includes the factor work done inside the forward and backward hooks."""
        return dict(self._stage_seconds)

    def assignment_summary(self) -> str:
        """Per-rank load and memory of the current placement, as a table."""
        plan = {n: s.work for n, s in self.layers.items() if s.work is not None}
        return asg.summary(plan, self.comm.world_size, self.assignment_strategy)

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on this rank by category: running factors, decompositions, batch buffers."""
        factors = decomps = buffers = 0
        for s in self.layers.values():
            factors += tensor_bytes(s.a_factor, s.g_factor)
            decomps += result_bytes(s.a_decomp) + result_bytes(s.g_decomp) + tensor_bytes(s.outer)
            buffers += tensor_bytes(s.a_batch.total, s.g_batch.total)
        return {
            "factors": factors,
            "decompositions": decomps,
            "buffers": buffers,
            "total": factors + decomps + buffers,
        }

    def remove(self) -> None:
        """Detach every hook: the model trains as if the preconditioner had never been attached."""
        for layer in self.layers.values():
            layer.remove_hooks()
        self._root_handle.remove()
        self._collecting = False

    def state_dict(self, include_decompositions: bool = False) -> dict[str, Any]:
        """Steps, constant hyperparameters and every layer's running factors (gathered from their owners).

        Collective under torch.distributed: every rank calls it and receives the full state.
        With ``include_decompositions`` the current decompositions are saved too, so that a resumed run
        continues bit-identically even between decomposition steps.
        """
        hyper = {
            k: getattr(self, k)
            for k in (
                "factor_update_steps",
                "inv_update_steps",
                "damping",
                "factor_decay",
                "kl_clip",
                "lr",
            )
            if not callable(getattr(self, k))
        }
        layers: dict[str, dict[str, Any]] = {}
        for name, layer in self.layers.items():
            work = layer.work
            assert work is not None
            entry: dict[str, Any] = {}
            for kind, owner, dim in (
                ("a", work.a_owner, work.a_dim),
                ("g", work.g_owner, work.g_dim),
            ):
                entry[f"{kind}_factor"] = self._gather(getattr(layer, f"{kind}_factor"), owner, dim)
            if include_decompositions and self._has_decompositions:
                entry["decompositions"] = self._gather_decompositions(layer)
            layers[name] = entry
        return {"steps": self.steps, "hyperparameters": hyper, "layers": layers}

    def _gather(self, t: torch.Tensor | None, owner: int, dim: int) -> torch.Tensor | None:
        if not self.comm.distributed or self.factor_reduction is FactorReduction.ALLREDUCE:
            return None if t is None else t.clone()
        # Whether the owner has the factor yet is host state shared by all ranks (same step count).
        has = torch.tensor([t is not None], dtype=torch.int32)
        self.comm.broadcast_from(has, owner)
        if not has.item():
            return None
        buf = t.clone() if t is not None else torch.empty(dim, dim, dtype=self.factor_dtype)
        return self.comm.broadcast_from(buf, owner)

    def _gather_decompositions(self, layer: LayerState) -> dict[str, Result | None]:
        """The layer's decompositions (and outer product), from its first gradient worker to every rank."""
        work = layer.work
        assert work is not None
        parts: dict[str, Result | None] = {"a": layer.a_decomp, "g": layer.g_decomp}
        if self._uses_outer:
            parts["outer"] = None if layer.outer is None else {"outer": layer.outer}
        if not self.comm.distributed:
            return {
                k: None if r is None else {n: v.clone() for n, v in r.items()}
                for k, r in parts.items()
            }
        out: dict[str, Result | None] = {}
        for kind, res in parts.items():
            template = res if res is not None else self._empty_result(layer, kind)
            out[kind] = {
                n: self.comm.broadcast_from(
                    v.clone(memory_format=torch.contiguous_format), work.grad_workers[0]
                )
                for n, v in template.items()
            }
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Factors land on each layer's device; decompositions are taken from
        the state when saved, else recomputed now from the restored factors."""
        self.steps = int(state["steps"])
        for k, v in state.get("hyperparameters", {}).items():
            if not callable(getattr(self, k)):
                setattr(self, k, v)
        missing = set(self.layers) - set(state["layers"])
        if missing:
            raise KeyError(f"K-FAC state has no factors for layers: {sorted(missing)}")
        has_decomp = False
        for name, layer in self.layers.items():
            entry = state["layers"][name]
            work = layer.work
            assert work is not None
            dev = self._device(layer)
            keep_all = self.factor_reduction is FactorReduction.ALLREDUCE
            for kind, owner in (("a", work.a_owner), ("g", work.g_owner)):
                t = entry.get(f"{kind}_factor")
                keep = t is not None and (keep_all or owner == self.comm.rank)
                setattr(layer, f"{kind}_factor", t.to(dev, self.factor_dtype) if keep else None)
                layer.seen_a = layer.seen_g = True
            dec = entry.get("decompositions")
            if dec is not None:
                has_decomp = True
                holds = self.comm.rank in work.grad_workers
                for kind in ("a", "g"):
                    res = dec.get(kind)
                    val = (
                        {k: v.to(dev) for k, v in res.items()}
                        if res is not None and holds
                        else None
                    )
                    setattr(layer, f"{kind}_decomp", val)
                outer = dec.get("outer")
                layer.outer = outer["outer"].to(dev) if outer is not None and holds else None
        self._collecting = is_due(self.factor_update_steps, self.steps)
        if self.steps > 0 and not has_decomp:
            self._update_second_order(resolve(self.damping, self.steps))
            self._broadcast_second_order()
        self._has_decompositions = self.steps > 0


def _fraction(value: float | DistributedStrategy | str, world_size: int) -> float:
    """A grad-worker fraction from a number or a strategy name (HYBRID-OPT's default is 1/2)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    strategy = DistributedStrategy.parse(value)
    if strategy is DistributedStrategy.COMM_OPT:
        return 1.0
    if strategy is DistributedStrategy.MEM_OPT:
        return 1.0 / world_size
    return 0.5 if world_size > 1 else 1.0
