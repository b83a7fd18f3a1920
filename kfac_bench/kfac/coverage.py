"""What K-FAC covers in a model: the share of parameters preconditioned and what was left out, and why.

Reasons a module is left out (keys of :attr:`Coverage.left_out`):

``skipped_by_rule``      matched ``skip_layers``
``unsupported_type``     holds a weight matrix or kernel, but no handler is registered for its type
``not_a_weight_matrix``  holds only ≥2-D tensors with a dimension of size 1, broadcast against activations
                         (a class token, a position embedding, a layer scale): not weight matrices (not in
                         ``eligible_params``), no Kronecker factors; they keep their plain gradient
``subclass_own_forward`` a subclass of a registered type that overrides ``forward`` (timm's ``Conv2dSame``,
                         ``StdConv2d``): its base's handler would model another computation; register one
``grouped_conv``         a grouped or depthwise ``Conv2d`` (its Fisher block is not modelled)
``used_functionally``    its weight is read by its parent's forward, so its hooks never see it run (the
                         ``out_proj`` of ``nn.MultiheadAttention``, torchvision Swin's ``qkv``/``proj``);
                         known from the module tree, or found at run time: its weight had a gradient at a
                         decomposition step but its hooks saw no call
``tied``                 its weight (or bias) is also held by another module (e.g. a decoder tied to the
                         token embedding): preconditioning it would rewrite a gradient that carries both
                         modules' contributions
``computed_weight``      its weight is recomputed from other parameters before each forward (old-API
                         ``torch.nn.utils.prune``, ``spectral_norm``, ``weight_norm``), also when applied
                         after construction (found at the next ``step()``)
``lazy_uninitialised``   a Lazy module before its first forward: it is registered at the end of the first
                         ``step()`` after it (its weight has no shape before)
``unsupported_config``   a handler rejected it or failed on it (e.g. a parametrized or non-float weight)
``did_not_run``          registered, but had no factors at the last decomposition step (never ran, or not yet;
                         e.g. every call under ``no_grad``)
``decomposition_failed`` registered, but its first decomposition failed even in float64 (plain gradient
                         until one succeeds)
``eval_mode``            registered, but in ``eval()`` mode while its weight gets gradients (its forwards are
                         not recorded: call ``.train()`` on it, or skip it)
``read_outside_call``    its weight also received gradient from outside its module's call (read
                         functionally elsewhere, e.g. ``F.linear(h, enc.weight.t())`` in a tied autoencoder):
                         ``A ⊗ G`` models the call only, so it keeps its plain gradient (:mod:`.outside`)

Run-time findings (``did_not_run``, ``decomposition_failed``, ``used_functionally`` found at run time) are
known only once training ran; before that a registered layer counts as preconditioned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONS = (
    "skipped_by_rule",
    "unsupported_type",
    "not_a_weight_matrix",
    "subclass_own_forward",
    "grouped_conv",
    "used_functionally",
    "tied",
    "computed_weight",
    "lazy_uninitialised",
    "unsupported_config",
    "did_not_run",
    "decomposition_failed",
    "eval_mode",
    "read_outside_call",
)


@dataclass(frozen=True)
class Coverage:
    """The coverage report; :meth:`to_dict` is JSON-serialisable, ``str()`` is one line.

    Attributes:
        layers: layers preconditioned.
        preconditioned_params: trainable parameters in their K-FAC blocks (weights and trainable biases).
        trainable_params: all trainable parameters of the model (each shared parameter once).
        eligible_params: trainable parameters of modules that hold a weight matrix or kernel (≥ 2-D): what a
            K-FAC layer type could hold (normalisation layers and standalone vectors excluded).
        left_out: reason -> qualified module names (reasons in the module docstring).
        unsupported_types: class name -> number of modules of an unsupported type holding such a weight.
        threshold: ``eligible_share`` below which the preconditioner warns.
    """

    layers: int
    preconditioned_params: int
    trainable_params: int
    eligible_params: int
    left_out: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unsupported_types: dict[str, int] = field(default_factory=dict)
    threshold: float = 0.5

    @property
    def share(self) -> float:
        """Preconditioned / trainable parameters."""
        return self.preconditioned_params / self.trainable_params if self.trainable_params else 0.0

    @property
    def eligible_share(self) -> float:
        """Preconditioned / eligible parameters: 1.0 for a model without any eligible parameter, 0.0 when
        nothing is eligible only because what was left out has no shape yet (Lazy modules: "100 % of 0"
        would read as full coverage)."""
        if self.eligible_params:
            return self.preconditioned_params / self.eligible_params
        return 0.0 if self.layers == 0 and self.left_out else 1.0

    @property
    def below_threshold(self) -> bool:
        return self.eligible_share < self.threshold

    def to_dict(self) -> dict[str, Any]:
        """Plain ints, floats, strings, lists and dicts only (for ``json.dumps``)."""
        return {
            "layers": self.layers,
            "preconditioned_params": self.preconditioned_params,
            "trainable_params": self.trainable_params,
            "eligible_params": self.eligible_params,
            "share": self.share,
            "eligible_share": self.eligible_share,
            "threshold": self.threshold,
            "below_threshold": self.below_threshold,
            "left_out": {k: list(v) for k, v in self.left_out.items()},
            "unsupported_types": dict(self.unsupported_types),
        }

    def __str__(self) -> str:
        head = (
            f"K-FAC preconditions {self.layers} layers: {100 * self.share:.1f}% of "
            f"{_count(self.trainable_params)} trainable parameters ({100 * self.eligible_share:.1f}% of the "
            f"{_count(self.eligible_params)} in weight matrices/kernels)"
        )
        parts = []
        for reason in REASONS:
            names = self.left_out.get(reason, ())
            if not names:
                continue
            shown = [n or "(root)" for n in names[:3]]  # the root module's name is empty
            listed = ", ".join(shown) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
            if reason == "unsupported_type":
                types = ", ".join(f"{t}×{n}" for t, n in self.unsupported_types.items())
                listed = f"{types}: {listed}"
            label = _LABELS.get(reason, reason.replace("_", " "))
            parts.append(f"{label} {len(names)} ({listed})")
        return head + ("; left out: " + "; ".join(parts) if parts else "")


_LABELS = {
    "not_a_weight_matrix": "not weight matrices (token, position embedding, layer scale: plain gradient)",
    "subclass_own_forward": "subclass with its own forward — register a handler",
    "eval_mode": "in eval() mode while training",
    "read_outside_call": "gradient also from outside its module's call",
}


def _count(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    if n >= 10**6:
        return f"{n / 1e6:.2f}M"
    if n >= 10**3:
        return f"{n / 1e3:.1f}k"
    return str(n)
