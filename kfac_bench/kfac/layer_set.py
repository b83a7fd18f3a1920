"""The layers a preconditioner holds, kept in step with the live model.

:class:`LayerSet` registers the layers :func:`~.registration.scan_model` returns (one :class:`LayerState`
each) and follows the model after construction: around every ``step()``, :meth:`LayerSet.following_changes`
compares each layer's ``requires_grad``, module and weight with what was registered, and registers the
layers again when anything changed (a layer frozen or unfrozen, pruned, replaced, a Lazy module
materialised). It also records what is learnt only at run time: layers in ``eval()`` mode, layers whose
weight is read outside their module's call (:mod:`.outside`), layers used functionally. All of it feeds
:meth:`LayerSet.coverage`.

The ``layers`` dict is the one the capture hooks, the curvature and the gradient stages read: it is
updated in place, never replaced. The hooks (the capture) and the placement belong to the preconditioner,
so registering again takes them as arguments. Dtypes are chosen once (:func:`resolve_dtypes`); a model
converted afterwards is reported, not followed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .comm import Communicator
from .coverage import Coverage
from .layers import AttentionProjection, handler_for
from .log import WarnOnce, logger
from .outside import OutsideGradients
from .registration import LayerSpec, ModelScan, batch_dim_of, log_scan, scan_model, structure
from .state import LayerState

if TYPE_CHECKING:
    from .capture import Capture

__all__ = ["LayerSet", "resolve_dtypes"]

#: ``(weight, bias)`` ``requires_grad`` of a layer.
Trainable = tuple[bool, bool]


class LayerSet:
    """The registered layers of ``model`` and what registration read from it.

    Args:
        model: the bare model (not a DDP wrapper).
        skip_layers, batch_dim, coverage_threshold: the preconditioner's arguments of those names.
        comm: the preconditioner's communicator (rank 0 logs; flags are agreed over its group).
        warn: the preconditioner's once-per-key warnings.
        dtypes: the preconditioner's ``(factor_dtype, inv_dtype)``, chosen once.

    Attributes:
        layers: qualified name -> :class:`LayerState`, shared with the stages (updated in place).
        scan: the latest :func:`~.registration.scan_model` of the model.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        skip_layers: Sequence[str],
        batch_dim: int | Mapping[str, int] | None,
        coverage_threshold: float,
        comm: Communicator,
        warn: WarnOnce,
        dtypes: tuple[torch.dtype, torch.dtype],
    ) -> None:
        self.model = model
        self.skip_layers = skip_layers
        self.batch_dim = batch_dim
        self.coverage_threshold = coverage_threshold
        self.comm = comm
        self._warn = warn
        self.factor_dtype, self.inv_dtype = dtypes
        # The factor dtype the model implied when the dtypes were chosen: a later change is reported.
        self._model_dtype = resolve_dtypes(model, None, None)[0]
        self.scan: ModelScan = scan_model(model, skip_layers)
        self.layers: dict[str, LayerState] = {
            s.name: self._layer_state(s) for s in self.scan.layers
        }
        self._trainable = self._trainable_now()
        self._structure = structure(model)
        if comm.rank == 0:  # every rank scans the same model: one report per group
            log_scan(self.scan, self.coverage())

    def coverage(self) -> Coverage:
        """See :meth:`~kfac_bench.kfac.KFACPreconditioner.coverage`."""
        not_ready: dict[str, str] = {}
        for n, s in self.layers.items():
            reason = s.left_out or ("eval_mode" if s.eval_mode else None) or s.not_ready_reason
            if reason is not None:
                not_ready[n] = reason
        scan = self.scan
        if self._trainable_now() != self._trainable:
            scan = scan_model(self.model, self.skip_layers)
            not_ready = {n: r for n, r in not_ready.items() if n in {s.name for s in scan.layers}}
        return scan.coverage(self.coverage_threshold, not_ready)

    # ------------------------------------------------------------------ following the model
    @contextlib.contextmanager
    def following_changes(self, capture: Capture, replan: Callable[[], None]) -> Iterator[set[str]]:
        """Around one ``step()``: yields the registered layers whose ``requires_grad``, module or weight
        changed since the last step (they keep their plain gradient in it: a pruned weight, a replaced
        module); if anything changed (also a Lazy module materialised), registers the layers again when
        the step has completed, hooking new ones with ``capture`` and placing them with ``replan``. A
        dtype change is reported, not followed (dtypes are chosen once)."""
        trainable, shape = self._trainable_now(), structure(self.model)
        changed = {n for n in self.layers if trainable.get(n) != self._trainable.get(n)}
        if shape != self._structure:
            changed |= {n for n, layer in self.layers.items() if self._replaced(n, layer)}
            self._warn_dtype()
        yield changed
        if trainable != self._trainable or shape != self._structure:
            self._register_again(trainable, capture, replan)

    def _layer_state(self, spec: LayerSpec) -> LayerState:
        return LayerState(
            spec.name,
            spec.module,
            spec.handler,
            spec.a_dim,
            spec.g_dim,
            spec.bias,
            batch_dim=batch_dim_of(spec, self.batch_dim),
            param_id=id(spec.handler.parameters(spec.module)[0]),
            attention=spec.attention,
        )

    def _trainable_now(self) -> dict[str, Trainable]:
        """``(weight, bias)`` ``requires_grad`` of every registered layer and of every layer left out
        only for a frozen weight."""
        out = {}
        for name, layer in self.layers.items():
            w, b = layer.handler.parameters(layer.module)
            out[name] = (w.requires_grad, b is not None and b.requires_grad)
        for name in self.scan.frozen:
            try:
                module = self.model.get_submodule(name)
            except AttributeError:  # replaced or deleted since the scan: structure() re-scans
                continue
            handler = handler_for(module)
            if handler is None:
                continue
            w, b = handler.parameters(module)
            out[name] = (w.requires_grad, b is not None and b.requires_grad)
        return out

    def _replaced(self, name: str, layer: LayerState) -> bool:
        """Whether the model no longer holds ``layer``'s module under its name with the same weight."""
        try:
            if isinstance(layer.module, AttentionProjection):  # not in the tree: its owner is
                owner = self.model.get_submodule(name.rpartition(".")[0])
                if owner is not layer.module.owner:
                    return True
                module: nn.Module = layer.module
            else:
                module = self.model.get_submodule(name)
            weight = layer.handler.parameters(module)[0]
        except (AttributeError, AssertionError):
            return True
        return module is not layer.module or id(weight) != layer.param_id

    def _warn_dtype(self) -> None:
        """Once: the model's weights changed dtype after construction, away from the factors' (which keep
        theirs; factors given explicitly in another dtype than the model's are no change)."""
        dtypes = {
            str(layer.handler.parameters(layer.module)[0].dtype) for layer in self.layers.values()
        }
        now = resolve_dtypes(self.model, None, None)[0]
        if now != self._model_dtype and now != self.factor_dtype and self.comm.rank == 0:
            self._warn(
                "dtype",
                "K-FAC: the model's weights are %s, but factors are %s and decompositions %s (chosen at "
                "construction, before the model's dtype changed): build the preconditioner after "
                "converting the model, or pass factor_dtype/inv_dtype",
                "/".join(sorted(dtypes)),
                self.factor_dtype,
                self.inv_dtype,
            )

    def _register_again(
        self, trainable: dict[str, Trainable], capture: Capture, replan: Callable[[], None]
    ) -> None:
        """Scan again after ``requires_grad`` or the model's structure changed: unchanged layers keep their
        state, changed ones start afresh, new ones are hooked; then placement is recomputed (the same on
        every rank). A registered layer that is left out now is named in one warning, with its reason."""
        scan = scan_model(self.model, self.skip_layers)
        old, new = dict(self.layers), {}
        for spec in scan.layers:
            layer = old.pop(spec.name, None)
            if (
                layer is None
                or trainable.get(spec.name) != self._trainable.get(spec.name)
                or layer.module is not spec.module
                or layer.param_id != id(spec.handler.parameters(spec.module)[0])
            ):
                if layer is not None:
                    layer.remove_hooks()
                layer = self._layer_state(spec)
                capture.attach(layer)
            new[spec.name] = layer
        for layer in old.values():
            layer.remove_hooks()
        self.layers.clear()  # shared with capture, curvature and gradients
        self.layers.update(new)
        self.scan = scan
        self._trainable = self._trainable_now()
        self._structure = structure(self.model)
        replan()
        capture.outside.start()
        if self.comm.rank == 0:
            gone = {n: scan.details.get(n, "not in the model any more") for n in old}
            gone = {n: why for n, why in gone.items() if n not in scan.frozen}
            if gone:
                self._warn(
                    "left_out:" + ",".join(sorted(gone)),
                    "K-FAC: the model changed after construction; left out now (plain gradient): %s",
                    "; ".join(f"'{n}': {why}" for n, why in sorted(gone.items())),
                )
            logger.info(
                "K-FAC: the model changed (requires_grad, modules or weights); layers registered "
                "again: %s",
                self.scan.coverage(self.coverage_threshold),
            )

    # ------------------------------------------------------------------ what only a run shows
    def in_eval_mode(self) -> set[str]:
        """The layers in ``eval()`` mode whose weight has a gradient (``model.train(False)`` mid-run): their
        forwards are not recorded, so they keep their plain gradient in this step and ``coverage()`` reports
        them as ``eval_mode``; warned once, naming them."""
        found = set()
        for name, layer in self.layers.items():
            evaluating = (
                not layer.module.training and layer.handler.grad(layer.module, False) is not None
            )
            layer.eval_mode = evaluating
            if evaluating:
                found.add(name)
        if found and self.comm.rank == 0:
            shown = sorted(found)
            self._warn(
                "eval_mode",
                "K-FAC: %d layer(s) are in eval() mode while their weights get gradients (%s%s): eval-mode "
                "forwards are not recorded (validation), so their factors would not follow the training; "
                "they keep their plain gradients and coverage() reports them as eval_mode. Call "
                "model.train() before training forwards (keep dropout or BatchNorm in eval() per module)",
                len(found),
                ", ".join(shown[:3]),
                f", +{len(shown) - 3} more" if len(shown) > 3 else "",
            )
        return found

    def leave_out_read_outside(self, outside: OutsideGradients) -> None:
        """After the first recorded step's backward: leave out the layers whose weight also received
        gradient from outside their module's call (:mod:`.outside`); every rank agrees."""
        flagged = dict(outside.flagged)
        outside.stop()
        names = sorted(self.layers)
        if self.comm.distributed:
            flags = torch.tensor([flagged.get(n, 0.0) for n in names], device=self.comm.device)
            self.comm.all_reduce_max(flags, "outside_gradients")
            flagged = {n: f for n, f in zip(names, flags.tolist()) if f > 0}
        for name, share in flagged.items():
            self.layers[name].left_out = "read_outside_call"
            if self.comm.rank == 0:
                self._warn(
                    f"outside:{name}",
                    "K-FAC layer '%s': %.0f%% of its weight's gradient came from outside its module's "
                    "call (read functionally elsewhere, e.g. a tied transposed decoder); A ⊗ G models the "
                    "call only, so the layer is left out (plain gradient)",
                    name,
                    100 * share,
                )

    def check_runtime_coverage(self) -> None:
        """After a decomposition step: a layer without factors whose weight has a gradient was used
        functionally; warn once (rank 0) if what ran is under ``coverage_threshold``."""
        if all(layer.ready for layer in self.layers.values()):
            return
        for layer in self.layers.values():
            if layer.not_ready_reason == "did_not_run" and not layer.received:
                # A zero-filled .grad (an idle expert's, filled by the loop) says nothing ran through it.
                grad = layer.handler.grad(layer.module, False)
                if grad is not None and bool(grad.any()):
                    # Hooks record training-mode forwards only: a submodule in eval() is not functional.
                    training = layer.module.training
                    layer.not_ready_reason = "used_functionally" if training else "eval_mode"
        coverage = self.coverage()
        if coverage.below_threshold and self.comm.rank == 0:
            self._warn(
                "runtime_coverage",
                "K-FAC at run time covers only %.1f%% of the parameters in weight matrices/kernels "
                "(threshold %.0f%%): %s",
                100 * coverage.eligible_share,
                100 * coverage.threshold,
                coverage,
            )


def resolve_dtypes(
    model: nn.Module, factor_dtype: torch.dtype | None, inv_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """The ``(factor_dtype, inv_dtype)`` a preconditioner of ``model`` uses for these arguments: the given
    ones, else float32 for low-precision or float32 models, float64 for float64 ones."""
    param = next(model.parameters(), None)
    low = param is None or param.dtype in (torch.float16, torch.bfloat16)
    default = torch.float32 if low or param is None else param.dtype
    factor = factor_dtype or default
    inv = inv_dtype or (torch.float64 if factor == torch.float64 else torch.float32)
    return factor, inv
