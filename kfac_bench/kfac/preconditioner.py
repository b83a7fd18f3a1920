"""KFACPreconditioner: factors -> second order -> precondition -> KL clip -> write gradients.

Usage (any PyTorch loop; with DDP, after its gradient averaging; with AMP, after ``scaler.unscale_``)::

    precond = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
    loss.backward()
    precond.step()
    optimizer.step()

The jobs live in their own modules: :mod:`.capture` (hooks), :mod:`.curvature` (stages 1 and 2),
:mod:`.gradients` (stages 3 and 4), :mod:`.second_order` (the method, chosen once), :mod:`.assignment` and
:mod:`.comm` (where work runs and what is sent), :mod:`.checkpoint`, :mod:`.registration` (which layers,
with which settings) and :mod:`.layer_set` (the registered layers, kept in step with the live model and
registered again when it changes). What stays here is the public class: its arguments, the parts it builds
from them, the placement of the layers' work, and ``step()`` as the algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import assignment as asg
from . import checkpoint
from .capture import Capture
from .comm import Communicator, factor_entries
from .coverage import Coverage
from .curvature import Curvature
from .gradients import Gradients
from .layer_set import LayerSet, resolve_dtypes
from .log import WarnOnce
from .options import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    FactorScaling,
    Placement,
    parse_grad_worker_fraction,
)
from .schedules import Scheduled, is_due, resolve
from .second_order import RankRule, second_order_method
from .state import memory_by_category
from .subsample import ExampleSubset, PositionSubset, check_fraction
from .timing import STAGES, StageTimer

__all__ = ["STAGES", "KFACPreconditioner", "resolve_dtypes"]


class KFACPreconditioner:
    """Distributed K-FAC preconditioner for the ``nn.Linear``, ``nn.Conv2d``, ``nn.Conv1d`` and
    ``nn.MultiheadAttention`` layers of a model (and any layer type registered with
    :func:`~kfac_bench.kfac.register_layer_type`).

    ``step()`` rewrites the ``.grad`` of every registered layer with its K-FAC preconditioned (and KL-clipped)
    gradient; any optimizer then applies it. Other parameters keep their plain gradients.

    Args:
        model: the model (a ``DistributedDataParallel`` wrapper is unwrapped).
        factor_update_steps: steps between factor updates (TPDS §4.3), constant or callable of ``steps``.
        inv_update_steps: steps between decompositions; preconditioning uses the cached ones in between.
        damping: γ (Tikhonov damping), constant or callable.
        factor_decay: running-average decay (keep this share of the old factor), constant or callable.
        kl_clip: κ of the gradient scaling ν = min(1, sqrt(κ / |Σ lr²⟨∇̃W, ∇W⟩|)); None disables it.
        lr: the learning rate used by KL clipping, constant or callable.
        accumulation_steps: micro-batches per optimizer step (each loss divided by this number).
        compute_method: ``'eigen'`` (default, all the paper's results), ``'inverse'``, or the opt-in
            approximation ``'eigen_lowrank'`` (top-k eigenpairs of large Linear-layer factors plus one scalar
            for the rest, warm-started from the previous basis; see ``lowrank_fraction``).
        compute_eigenvalue_outer_product: precompute ``1/(λ_G λ_Aᵀ + γ)`` on decomposition steps (KAISA §4.4);
            needs A and G on the same rank, so it is ignored when ``colocate_factors=False``.
        factor_dtype: dtype of factors (default: float32, or float64 for a float64 model).
        inv_dtype: dtype of decompositions (default: float32, or float64 with float64 factors).
        skip_layers: regexes; a layer is skipped if one matches (``re.search``) its qualified name or its
            class name.
        grad_scaler: a ``torch.amp.GradScaler`` or a callable returning the loss scale; G is unscaled with it.
        factor_scaling: ``'expand'`` (default: every row of a Linear-type layer one term of the loss's mean,
            whatever the input's layout; KFC for convolutions), ``'per_example'`` (the SC20/TPDS ResNet code)
            or ``'kaisa'`` (the KAISA-era code); see :mod:`kfac_bench.kfac.factors`.
        grad_worker_fraction: share of ranks that precondition each layer: 1 = COMM-OPT, 1/world = MEM-OPT,
            in between HYBRID-OPT; the strings ``'comm_opt'``, ``'mem_opt'`` and ``'hybrid_opt'`` (= 0.5)
            work too (parsed by :func:`~kfac_bench.kfac.options.parse_grad_worker_fraction`).
        assignment_strategy: cost of a factor for placement, ``'compute'`` (n³) or ``'memory'`` (n²).
        colocate_factors: decompose a layer's A and G on the same rank.
        placement: ``'lpt'`` (KAISA's greedy longest-processing-time) or ``'round_robin'`` (SC20).
        factor_reduction: ``'allreduce'`` (every rank keeps every factor) or ``'reduce'`` (only its owner).
        allreduce_bucket_cap_mb: bucket size of the factor reduction.
        symmetry_aware: communicate only the upper triangle of symmetric factors.
        comm_dtype: dtype of the factor communication (e.g. ``torch.bfloat16``); default: the factor dtype.
        track_stage_times: accumulate wall time per stage (synchronising CUDA around stages), see
            :meth:`stage_times`.
        process_group: the ranks K-FAC runs over (default: the world), e.g. the data-parallel group under
            tensor or pipeline parallelism, or a group of one rank to stay local inside a distributed job.
            Every member must construct its preconditioner with the same group.
        coverage_threshold: warn once at construction if the layers preconditioned hold less than this share
            of the parameters a K-FAC layer type could hold (see :meth:`coverage`), and once more after a
            decomposition step if the layers that actually ran hold less.
        factor_batch_fraction: share of each micro-batch's examples the factor statistics are computed
            from, in (0, 1]; 1 (default) is exact, less is an opt-in approximation whose noise the running
            average absorbs, for a factor stage about that much cheaper (:mod:`kfac_bench.kfac.subsample`).
        batch_dim: the dimension of the examples in the layers' inputs and outputs, used by
            ``factor_scaling='per_example'`` to count examples and positions and by
            ``factor_batch_fraction`` to draw examples: an int for every layer, or a
            dict of regexes (``re.search`` on the qualified name) -> dim; layers it does not set keep the
            detected one: 1 for the Linear layers of a sequence-first (``batch_first=False``)
            ``nn.TransformerEncoderLayer``/``DecoderLayer``, else 0. Convolutions take 0 only.
        lowrank_fraction: with ``compute_method='eigen_lowrank'``, the rank kept of each large Linear-layer
            factor as a share of its size, in (0, 1] (1: exact); see :mod:`.second_order.lowrank`.
        lowrank_min_dim: with ``'eigen_lowrank'``, factors smaller than this (and every convolution factor)
            keep their exact ``eigh``.
        factor_position_fraction: share of the rows of output positions of each convolution call the
            factor statistics are computed from, in (0, 1]; 1 (default) is exact, less an opt-in unbiased
            estimate (same module); layers without positions are unaffected.

    Note:
        What the hooks count and when (one micro-batch = one backward pass; eval-mode forwards ignored; AMP)
        is the contract in :mod:`kfac_bench.kfac.capture`. Layers are chosen by
        :func:`~kfac_bench.kfac.registration.scan_model`: registered types
        (:func:`~kfac_bench.kfac.register_layer_type`), minus ``skip_layers``, grouped convolutions, weights
        used functionally and weights tied to another module (one log line names them), with frozen biases
        left out of the block. A layer that has no factors yet, or whose first decomposition failed even in
        float64, keeps its plain gradient and is checked again at every decomposition step.

        ``requires_grad`` is read at every ``step()``: a layer frozen (weight or bias) since the last step
        keeps its plain gradient in that step, and the layers are registered again at its end (a layer
        unfrozen later joins, with new factors; freeze the same layers on every rank). After the first
        decomposition step the coverage is checked against what actually ran (:meth:`coverage`), and
        ``coverage_threshold`` is checked again then.
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
        factor_scaling: FactorScaling | str = FactorScaling.EXPAND,
        grad_worker_fraction: float | DistributedStrategy | str = 1.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        placement: Placement | str = Placement.LPT,
        factor_reduction: FactorReduction | str = FactorReduction.ALLREDUCE,
        allreduce_bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
        comm_dtype: torch.dtype | None = None,
        track_stage_times: bool = False,
        process_group: dist.ProcessGroup | None = None,
        coverage_threshold: float = 0.5,
        factor_batch_fraction: float = 1.0,
        batch_dim: int | Mapping[str, int] | None = None,
        lowrank_fraction: float = 0.25,
        lowrank_min_dim: int = 1024,
        factor_position_fraction: float = 1.0,
    ) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.model = model
        # The hyperparameters as given: constants, or callables of ``steps`` resolved at each step.
        self.factor_update_steps = factor_update_steps
        self.inv_update_steps = inv_update_steps
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.accumulation_steps = accumulation_steps
        # The options, checked and parsed (closed choices accept their strings).
        self.compute_method = ComputeMethod.parse(compute_method)
        self.factor_scaling = FactorScaling.parse(factor_scaling)
        self.assignment_strategy = AssignmentStrategy.parse(assignment_strategy)
        self.placement = Placement.parse(placement)
        self.factor_reduction = FactorReduction.parse(factor_reduction)
        self.factor_batch_fraction = check_fraction(factor_batch_fraction)
        self.factor_position_fraction = check_fraction(
            factor_position_fraction, "factor_position_fraction"
        )
        self.colocate_factors = colocate_factors
        self.skip_layers = list(skip_layers)
        self.grad_scaler = grad_scaler
        self.coverage_threshold = coverage_threshold
        self.batch_dim = batch_dim
        self.factor_dtype, self.inv_dtype = resolve_dtypes(model, factor_dtype, inv_dtype)
        self.steps = 0
        self._removed = False
        # The parts, each chosen once: method, group, layers, placement, stages.
        self.method = second_order_method(
            self.compute_method,
            self.inv_dtype,
            compute_eigenvalue_outer_product and colocate_factors,
            RankRule(lowrank_fraction, lowrank_min_dim),
        )
        self.timer = StageTimer(track_stage_times)
        self._warn = WarnOnce()
        self.comm = Communicator(
            {}, allreduce_bucket_cap_mb, symmetry_aware, comm_dtype, group=process_group
        )
        self.grad_worker_fraction = self._fraction_of_ranks(grad_worker_fraction)
        self.layer_set = LayerSet(
            model,
            skip_layers=self.skip_layers,
            batch_dim=batch_dim,
            coverage_threshold=coverage_threshold,
            comm=self.comm,
            warn=self._warn,
            dtypes=(self.factor_dtype, self.inv_dtype),
        )
        self.layers = self.layer_set.layers  # shared with the stages, updated in place
        self._plan()
        self._build_stages()

    def _fraction_of_ranks(self, grad_worker_fraction: float | DistributedStrategy | str) -> float:
        """``grad_worker_fraction`` as a share of this group's ranks (a strategy's name resolved)."""
        fraction = parse_grad_worker_fraction(grad_worker_fraction)
        if isinstance(fraction, DistributedStrategy):
            return fraction.fraction(self.comm.world_size)
        return fraction

    def _build_stages(self) -> None:
        """The stages over the shared ``layers``: curvature (1, 2), gradients (3, 4) and the hooks that
        capture each micro-batch's factor statistics, started on step 0."""
        self.curvature = Curvature(
            self.layers,
            self.comm,
            self.method,
            scaling=self.factor_scaling,
            timer=self.timer,
            warn=self._warn,
        )
        self.gradients = Gradients(self.layers, self.comm, self.method, self.timer)
        self.capture = Capture(
            self.layers,
            factor_dtype=self.factor_dtype,
            scaling=self.factor_scaling,
            accumulation_steps=self.accumulation_steps,
            grad_scaler=self.grad_scaler,
            on_final=self.curvature.factors_final,
            timer=self.timer,
            subset=self._example_subset(),
            positions=self._position_subset(),
        )
        self.curvature.step_terms = lambda: self.capture.step_terms
        self.capture.start_step(is_due(self.factor_update_steps, 0))
        self.capture.outside.start()

    def _example_subset(self) -> ExampleSubset | None:
        """The subset rule of ``factor_batch_fraction`` (None for 1: the exact path, untouched)."""
        if self.factor_batch_fraction == 1.0:
            return None
        return ExampleSubset(self.factor_batch_fraction, self.factor_scaling, lambda: self.steps)

    def _position_subset(self) -> PositionSubset | None:
        """The subset rule of ``factor_position_fraction`` (None for 1: the exact path, untouched)."""
        if self.factor_position_fraction == 1.0:
            return None
        return PositionSubset(self.factor_position_fraction, lambda: self.steps)

    # ------------------------------------------------------------------ placement
    def _plan(self) -> None:
        """(Re)compute the placement of every layer. Deterministic, so every rank agrees unasked."""
        plan = self._placement(self.comm.world_size)
        for name, work in plan.items():
            self.layers[name].work = work
        self.comm.set_groups(plan)
        entries = factor_entries(plan, self.factor_reduction is FactorReduction.REDUCE)
        self.comm.set_buckets(
            entries, torch.empty((), dtype=self.factor_dtype).element_size(), self.factor_dtype
        )

    def _placement(self, world_size: int) -> dict[str, asg.LayerWork]:
        """Where each layer's work runs on ``world_size`` ranks: :func:`~.assignment.assign`, the rule
        ``kfac-bench plan`` applies too, with the method's decomposition cost."""
        return asg.assign(
            list(self.layers.values()),
            world_size,
            self.grad_worker_fraction,
            self.method.decomposition_cost,
            self.assignment_strategy,
            self.colocate_factors,
            self.placement,
        )

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of this step: the four stages of one ``KFAC.step()`` (KAISA §3.4).

        Note:
            Call after ``loss.backward()`` (after DDP's all-reduce and ``GradScaler.unscale_``) and before
            ``optimizer.step()``; once per optimizer step, after all ``accumulation_steps`` micro-batches
            (backward passes).

        Raises:
            RuntimeError: no backward pass has reached the K-FAC layers yet, or after :meth:`remove`.
        """
        if self._removed:
            raise RuntimeError(
                "K-FAC step() after remove(): the preconditioner is detached; drop the precond.step() call "
                "or build a new KFACPreconditioner"
            )
        step = self.steps
        with self.layer_set.following_changes(self.capture, self._plan) as changed:
            evaluating = self.layer_set.in_eval_mode()
            if self.capture.collecting:
                self._check_micro_batches(bool(evaluating))
                if self.capture.outside.active:
                    self.layer_set.leave_out_read_outside(self.capture.outside)
            if is_due(self.factor_update_steps, step):  # 1. factors
                self.curvature.update_factors(resolve(self.factor_decay, step))
            if is_due(self.inv_update_steps, step):  # 2. second order
                self.curvature.update_second_order(resolve(self.damping, step))
                self.layer_set.check_runtime_coverage()
            raw = self.gradients.raw(skip=changed | evaluating)  # 3. precondition
            grads = self.gradients.precondition(raw, resolve(self.damping, step))
            # 4. KL clip, write
            self.gradients.clip_and_write(grads, raw, self.kl_clip, self.lr, step)
        self.steps += 1
        self.capture.start_step(is_due(self.factor_update_steps, self.steps))

    def _check_micro_batches(self, evaluating: bool = False) -> None:
        """A clear error for ``step()`` before any backward; a warning once if the count looks wrong."""
        backwards = self.capture.backwards
        if self.layers and not self.capture.ever:
            raise RuntimeError(
                "K-FAC step() was called before any backward pass reached the model's K-FAC layers: call "
                "loss.backward() on a training-mode forward (model.train(), gradients enabled) first (if "
                "the model reads every K-FAC layer's weight functionally, skip them with skip_layers)"
            )
        if backwards != self.accumulation_steps and not (evaluating and backwards == 0):
            self._warn(
                "micro_batches",
                "K-FAC: %d backward passes reached the K-FAC layers before step() %d, but "
                "accumulation_steps=%d (one backward pass is one micro-batch); factors use what ran",
                backwards,
                self.steps,
                self.accumulation_steps,
            )

    # ------------------------------------------------------------------ introspection / lifecycle
    def stage_times(self) -> dict[str, float]:
        """Cumulative seconds per stage since construction; ``factor`` includes the factor work done inside
        the forward and backward hooks. Empty, with a warning logged once, when the preconditioner is not
        tracking (built without ``track_stage_times=True``): zeros would read as stages that cost nothing."""
        if not self.timer.enabled:
            self._warn(
                "stage_times",
                "K-FAC stage_times(): not tracking (track_stage_times=False), so no stage was timed; build "
                "the preconditioner with track_stage_times=True (it synchronises CUDA around each stage)",
            )
            return {}
        return dict(self.timer.seconds)

    def assignment_summary(self) -> str:
        """Per-rank load and memory of the current placement, as a table."""
        plan = {n: s.work for n, s in self.layers.items() if s.work is not None}
        return asg.summary(plan, self.comm.world_size, self.assignment_strategy)

    def memory_usage(self) -> dict[str, int]:
        """Bytes K-FAC holds on this rank, by category. What each counts, to predict it from shapes
        (``d``: a factor's ``a_dim`` or ``g_dim``, see :func:`~kfac_bench.kfac.scan_model`; byte sizes of
        ``factor_dtype``, ``inv_dtype`` and ``comm_dtype``). ``total = factors + decompositions + buffers``;
        ``outer_products`` is part of ``decompositions``, ``batch_buffers + comm_buffers = buffers``.

        * ``factors``: running A and G, ``d²`` each in ``factor_dtype``, from the first factor step; every
          layer's on every rank with ``factor_reduction='allreduce'``, only the owned ones with ``'reduce'``.
        * ``decompositions``: the second-order parts held on each gradient worker of a layer, in
          ``inv_dtype``: ``d² + d`` per factor for ``eigen`` (eigenvectors, eigenvalues), ``d²`` for
          ``inverse``, ``d·k + k + 1`` for ``eigen_lowrank`` (``k`` its rank, ``d`` where exact), plus the
          outer products; from the first decomposition step.
        * ``outer_products``: ``eigen`` with ``compute_eigenvalue_outer_product``: ``g_dim·a_dim`` per layer
          (``k_g·k_a`` for ``eigen_lowrank``) on its gradient workers, in ``inv_dtype`` promoted to at least
          float32.
        * ``batch_buffers``: batch factors not yet packed for communication, in ``factor_dtype``: the
          accumulated sums (``d²`` per factor of each layer that ran), ``a_dim²`` per forward call waiting for
          its backward pass and, in a distributed factor step's last backward pass, the normalised factors
          handed to the reduction whose bucket is incomplete (``d²`` each). Peak: ``2·a_dim² + g_dim²`` per
          layer after the last forward while micro-batches accumulate; else ``a_dim² + g_dim²`` per layer from
          the backward pass to ``step()`` in one process; distributed, during the backward pass, 0 at its end.
          Layers whose handler computes grams in batches (Linear-type, Conv2d, Conv1d) hold no gram per
          waiting call (the input held is the one autograd holds anyway) but, from a call's gradient to
          the moment its key's last call has one (:mod:`~kfac_bench.kfac.batching`), its input and output
          gradient.
        * ``comm_buffers``: flat buffers of the launched factor buckets, ``d²`` (``d(d+1)/2`` with
          ``symmetry_aware``) per factor in ``comm_dtype``, from a bucket's launch in a factor step's last
          backward pass to ``step()`` (all of them at the end of that pass; 0 otherwise and in one process).
          Packing frees a bucket's factors and ``step()`` averages in place, so at the end of the pass
          ``buffers`` is the buckets alone. Broadcasts receive into the decompositions and gradients.
        """
        handed, comm = self.curvature.reduction_bytes()
        return memory_by_category(
            self.layers.values(), handed + self.capture.batch.held_bytes(), comm
        )

    def coverage(self) -> Coverage:
        """Which share of the model K-FAC preconditions and what it left out, by reason
        (:mod:`kfac_bench.kfac.coverage`). ``coverage().to_dict()`` is JSON-serialisable; ``str()`` is the
        one line logged at construction. Layers that are not ready after a decomposition step (did not
        run; used functionally; first decomposition failed) are reported as left out until they are;
        ``requires_grad`` is read now (a layer frozen or unfrozen since the last step is counted as it is
        now: it is registered again at the end of the next ``step()``)."""
        return self.layer_set.coverage()

    def remove(self) -> None:
        """Detach every hook: the model trains as if the preconditioner had never been attached
        (``step()`` raises from now on)."""
        self.capture.remove()
        self._removed = True

    def state_dict(self, include_decompositions: bool | None = None) -> dict[str, Any]:
        """Steps, constant hyperparameters and every layer's running factors (gathered from their owners).

        Collective under torch.distributed: every rank calls it and receives the full state.
        With ``include_decompositions`` the current decompositions are saved too, so that a resumed run
        continues bit-identically even between decomposition steps. Default: only for ``eigen_lowrank``,
        whose decompositions are warm-started from the previous ones (recomputing them from the factors
        would not resume what the run computes).
        """
        if include_decompositions is None:
            include_decompositions = self.compute_method is ComputeMethod.EIGEN_LOWRANK
        return checkpoint.gather_state(self, include_decompositions)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Factors land on each layer's device; decompositions are taken from
        the state when saved, else recomputed now from the restored factors."""
        checkpoint.restore_state(self, state)
