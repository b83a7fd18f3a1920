"""Which layers of a model K-FAC preconditions, decided from the module tree alone.

:func:`scan_model` walks the model once, without hooks and without allocating (it reads parameter shapes, so
it works on a model built on the meta device): every module of a registered layer type becomes a
:class:`LayerSpec` unless a rule leaves it out, and the reasons are collected for :class:`Coverage`.
The preconditioner registers exactly the layers this scan returns; a planner can use it to predict a run.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .coverage import Coverage
from .layers import LayerHandler, handler_for, overrides_forward
from .layers.attention import PARTS, projections
from .log import logger

#: Module types whose forward reads their child layers' weights directly (functionally), so the children's
#: hooks never fire: ``F.multi_head_attention_forward`` uses ``out_proj.weight``. An attention module that
#: is registered (:func:`expands_attention`) runs the engine's forward instead, where ``out_proj`` is called.
FUNCTIONAL_PARENTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)

#: The same for classes of other libraries, known by ``(module, class name)`` (the engine imports only
#: torch) -> the children used functionally: torchvision's Swin attention (V1 and its V2 subclass) calls
#: ``F.linear(x, self.qkv.weight, ...)`` and ``F.linear(x, self.proj.weight, ...)``. Layers used functionally
#: that no rule knows are found at run time (their weight has a gradient, their hooks saw nothing).
FUNCTIONAL_CHILDREN: dict[tuple[str, str], tuple[str, ...]] = {
    ("torchvision.models.swin_transformer", "ShiftedWindowAttention"): ("qkv", "proj"),
}

#: Module types whose Linear children see sequence-first inputs ``(T, N, ...)`` unless ``batch_first``.
SEQUENCE_FIRST_PARENTS: tuple[type[nn.Module], ...] = (
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)

#: The reason of a subclass of a registered type that overrides ``forward`` (``Coverage`` key
#: ``subclass_own_forward``).
OWN_FORWARD = "subclass with its own forward — register a handler"


@dataclass(frozen=True)
class LayerSpec:
    """A layer the engine preconditions: factors A (``a_dim²``) and G (``g_dim²``).

    Attributes:
        name: qualified module name.
        type: module class name.
        a_dim: input-factor size (input features or patch length, +1 with a trainable bias).
        g_dim: output-factor size (output features or channels).
        bias: whether the block includes the bias (the layer has one and it is trainable).
        params: trainable parameters the block covers.
        batch_dim: the examples' dimension of its input and output (1 inside a sequence-first
            ``nn.TransformerEncoderLayer``/``DecoderLayer``, else 0; ``KFACPreconditioner(batch_dim=...)``
            overrides it).
    """

    name: str
    type: str
    a_dim: int
    g_dim: int
    bias: bool
    params: int
    module: nn.Module = field(repr=False, compare=False)
    handler: LayerHandler = field(repr=False, compare=False)
    batch_dim: int = 0
    #: The ``nn.MultiheadAttention`` that must run the engine's forward for this layer's hooks to fire
    #: (its q/k/v projections and its ``out_proj``, :mod:`.layers.attention`); None for other layers.
    attention: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def spatial(self) -> bool:
        """Whether the layer's positions are spatial (a convolution), see :class:`LayerHandler`."""
        return self.handler.spatial


@dataclass
class ModelScan:
    """The result of :func:`scan_model`."""

    layers: list[LayerSpec]
    left_out: dict[str, list[str]]
    details: dict[str, str]  # module name -> why, as a phrase for logs
    unsupported_types: Counter[str]
    trainable_params: int
    eligible_params: int
    #: Tied weights: each left-out layer -> the other modules holding its weight or bias.
    tied: dict[str, list[str]]
    #: Layers of a registered type left out only because their weight is frozen (they join when unfrozen).
    frozen: list[str] = field(default_factory=list)

    def coverage(self, threshold: float = 0.5, not_ready: dict[str, str] | None = None) -> Coverage:
        """The coverage report; ``not_ready`` (layer -> runtime reason) moves layers to ``left_out``."""
        not_ready = not_ready or {}
        left = {k: list(v) for k, v in self.left_out.items()}
        for name, reason in not_ready.items():
            left.setdefault(reason, []).append(name)
        kept = [s for s in self.layers if s.name not in not_ready]
        return Coverage(
            layers=len(kept),
            preconditioned_params=sum(s.params for s in kept),
            trainable_params=self.trainable_params,
            eligible_params=self.eligible_params,
            left_out={k: tuple(v) for k, v in left.items() if v},
            unsupported_types=dict(self.unsupported_types),
            threshold=threshold,
        )


def scan_model(model: nn.Module, skip_layers: Sequence[str | re.Pattern[str]] = ()) -> ModelScan:
    """The layers K-FAC would precondition in ``model`` and what it would leave out (no hooks attached).

    Args:
        model: the model (a ``DistributedDataParallel`` wrapper is unwrapped); may live on the meta device.
        skip_layers: regexes; a layer is skipped if one matches (``re.search``) its qualified name or its
            class name.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    rules = [re.compile(p) for p in skip_layers]
    modules = list(model.named_modules())
    holders: dict[int, list[str]] = {}  # parameter id -> modules holding it directly
    functional: set[str] = set()
    sequence_first: set[str] = set()
    attention: dict[str, nn.MultiheadAttention] = {}
    trainable = {id(p): p.numel() for _, m in modules for p in _own(m) if p.requires_grad}
    eligible: dict[int, int] = {}
    for name, module in modules:
        own = _own(module)
        for p in own:
            holders.setdefault(id(p), []).append(name)
        registered = handler_for(module) is not None
        if _matrices(module) or (registered and any(p.requires_grad and p.dim() >= 2 for p in own)):
            eligible.update((id(p), p.numel()) for p in own if p.requires_grad)
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.MultiheadAttention) and expands_attention(module, name, rules):
            attention[name] = module
        elif isinstance(module, FUNCTIONAL_PARENTS):
            functional.update(prefix + child for child, _ in module.named_modules())
        for cls in type(module).__mro__:
            for child in FUNCTIONAL_CHILDREN.get((cls.__module__, cls.__name__), ()):
                sub = getattr(module, child, None)
                if isinstance(sub, nn.Module):
                    functional.update(prefix + n for n, _ in sub.named_modules(prefix=child))
        if isinstance(module, SEQUENCE_FIRST_PARENTS) and not _batch_first(module):
            sequence_first.update(prefix + child for child, _ in module.named_modules())
    scan = ModelScan([], {}, {}, Counter(), sum(trainable.values()), sum(eligible.values()), {})
    # The engine's attention forward feeds its projections and out_proj batch first.
    sequence_first -= {
        f"{n}." * bool(n) + c for n, m in attention.items() for c, _ in m.named_modules()
    }
    owner_of = {f"{n}." * bool(n) + "out_proj": (n, m) for n, m in attention.items()}
    for name, module in modules:
        skipped = isinstance(module, nn.MultiheadAttention) and name not in attention
        if skipped and handler_for(projections(module)[0]) is not None:
            scan.left_out.setdefault("skipped_by_rule", []).append(
                name
            )  # registered, skipped by a rule
            continue
        if name not in attention:  # an attention module's blocks are its projections (below)
            _classify(
                scan, name, module, rules, functional, holders, sequence_first, owner_of.get(name)
            )
        else:
            assert isinstance(module, nn.MultiheadAttention)
            for proj in projections(module):
                part = f"{name}." * bool(name) + f"{PARTS[proj.part]}_proj"
                _classify(scan, part, proj, rules, functional, holders, set(), (name, module))
    return scan


def expands_attention(
    module: nn.MultiheadAttention, name: str, rules: Sequence[re.Pattern[str]]
) -> bool:
    """Whether an attention module's projections are registered layers (the projection type has a handler
    and no ``skip_layers`` rule matches the module's name or class)."""
    if handler_for(projections(module)[0]) is None:
        return False
    return not any(r.search(name) or r.search(type(module).__name__) for r in rules)


def batch_dim_of(spec: LayerSpec, option: int | Mapping[str, int] | None) -> int:
    """The dimension of the examples in ``spec``'s inputs and output gradients: ``option`` (the engine's
    ``batch_dim``: an int for every layer, or regexes searched in the layer's name -> dim) where it says,
    else the one the scan detected.

    Raises:
        ValueError: a dimension other than 0 for a convolution (its examples are its input's dim 0).
    """
    batch_dim = spec.batch_dim
    if isinstance(option, int):
        batch_dim = option
    elif option is not None:
        batch_dim = next((d for p, d in option.items() if re.search(p, spec.name)), batch_dim)
    if batch_dim != 0 and spec.handler.spatial:
        raise ValueError(
            f"K-FAC layer '{spec.name}' ({spec.type}): batch_dim={batch_dim}, but a convolution's "
            "examples are its input's dim 0; set batch_dim for its Linear layers only"
        )
    return batch_dim


def _batch_first(module: nn.Module) -> bool:
    attention = getattr(module, "self_attn", None)
    return bool(getattr(attention, "batch_first", getattr(module, "batch_first", False)))


def _classify(
    scan: ModelScan,
    name: str,
    module: nn.Module,
    rules: list[re.Pattern[str]],
    functional: set[str],
    holders: dict[int, list[str]],
    sequence_first: set[str],
    owner: tuple[str, nn.Module] | None = None,
) -> None:
    """Add ``module`` to the scan: as a layer, as left out with a reason, or not at all. ``owner``: the
    attention module (name, module) whose forward feeds it (its parameters are not tied to it)."""
    handler = handler_for(module)
    if handler is None:
        own = [p for p in _own(module) if p.requires_grad and p.dim() >= 2]
        if _matrices(module):
            if overrides_forward(module):
                scan.left_out.setdefault("subclass_own_forward", []).append(name)
                scan.details[name] = OWN_FORWARD
                return
            scan.unsupported_types[type(module).__name__] += 1
            scan.left_out.setdefault("unsupported_type", []).append(name)
            why = next((w for t, w in _UNSUPPORTED_WHY.items() if isinstance(module, t)), None)
            if why is not None:
                scan.details[name] = f"unsupported type ({why})"
        elif own:
            names = [n for n, p in module._parameters.items() if any(p is q for q in own)]
            scan.left_out.setdefault("not_a_weight_matrix", []).append(name)
            scan.details[name] = (
                f"not a weight matrix ({', '.join(names)}: added or scaled elementwise, like a class "
                "token, a position embedding or a layer scale; K-FAC has no Kronecker factors for it, "
                "so it keeps its plain gradient and there is nothing to register)"
            )
        return
    if any(r.search(name) or r.search(type(module).__name__) for r in rules):
        scan.left_out.setdefault("skipped_by_rule", []).append(name)
        return
    try:
        weight, bias = handler.parameters(module)
        reason = computed_weight_reason(module)
        if reason is None and not weight.requires_grad:
            scan.frozen.append(name)
            return  # frozen: nothing to precondition, and not a trainable parameter either
        reason = reason or handler.unsupported_reason(module) or _weight_reason(weight)
        if reason is None and name in functional:
            reason = "used functionally"
        others = sorted(
            {n for p in (weight, bias) if p is not None for n in holders.get(id(p), [])}
            - {name, owner[0] if owner else name}
        )
        if reason is None and others:
            scan.tied[name] = others
            reason = f"tied (with {', '.join(others)})"
        if reason is None:
            use_bias = bias is not None and bias.requires_grad
            a_dim, g_dim = handler.dims(module, use_bias)
            params = a_dim * g_dim  # the block: weight and bias column
            spec = LayerSpec(
                name,
                type(module).__name__,
                a_dim,
                g_dim,
                use_bias,
                params,
                module,
                handler,
                batch_dim=1 if name in sequence_first else 0,
                attention=owner[1] if owner else None,
            )
            scan.layers.append(spec)
            return
    except Exception as err:  # a handler that cannot read the module must never break the model
        reason = f"unsupported config ({type(err).__name__}: {err})"
    key = reason.split(" (")[0].replace(" ", "_")
    scan.left_out.setdefault(key, []).append(name)
    scan.details[name] = reason


#: Why common layer types have no handler (the scan's detail for them, docs/engine.md "Layer types").
_UNSUPPORTED_WHY: dict[type[nn.Module], str] = {
    nn.Conv3d: "a Conv3d's patches are 3-D; the engine's exact patch kernels are 2-D",
    nn.modules.conv._ConvTransposeNd: (
        "a transposed convolution's patches are those of its input dilated by the stride and its "
        "weight is (in, out, ...); no handler models that"
    ),
    nn.Embedding: "a lookup, not a product with its input rows: no input factor",
}


def _matrix(name: str, p: torch.Tensor) -> bool:
    """Whether a parameter of a module without a handler is a weight matrix or kernel as such: at least
    2-D, and named a weight or without a dimension of size 1. Other tensors with one (a ``(1, 1, d)`` class
    token, a ``(1, T, d)`` position embedding, a ``(C, 1, 1)`` layer scale) are broadcast against
    activations: added or scaled elementwise."""
    return p.dim() >= 2 and ("weight" in name or 1 not in p.shape)


def _matrices(module: nn.Module) -> list[nn.Parameter]:
    """The trainable weight matrices and kernels a module holds itself (:func:`_matrix`)."""
    return [
        p
        for n, p in module._parameters.items()
        if p is not None
        and p.requires_grad
        and not isinstance(p, nn.parameter.UninitializedParameter)
        and _matrix(n, p)
    ]


def _own(module: nn.Module) -> list[nn.Parameter]:
    """Parameters held by ``module`` itself, without lazy ones that have no shape yet."""
    return [
        p
        for p in module._parameters.values()
        if p is not None and not isinstance(p, nn.parameter.UninitializedParameter)
    ]


#: Forward pre-hooks of ``torch.nn.utils`` that compute ``weight`` from other parameters before each forward
#: (class name -> what they are), the old API of pruning, spectral and weight normalisation.
_WEIGHT_HOOKS = {
    "SpectralNorm": "spectral_norm",
    "WeightNorm": "weight_norm",
    "PruningContainer": "torch.nn.utils.prune",
}


def computed_weight_reason(module: nn.Module) -> str | None:
    """Why ``module.weight`` is computed, not a parameter of its own (pruned, spectral- or
    weight-normalised with the old ``torch.nn.utils`` API, which sets ``weight`` from ``weight_orig`` or
    ``weight_g``/``weight_v`` in a forward pre-hook), as a ``computed_weight`` reason; None if not."""
    if isinstance(module._parameters.get("weight"), nn.Parameter):
        return None
    for hook in module._forward_pre_hooks.values():
        kind = _WEIGHT_HOOKS.get(type(hook).__name__)
        if kind is None and type(hook).__module__ == "torch.nn.utils.prune":
            kind = "torch.nn.utils.prune"
        if kind is not None:
            source = "weight_g, weight_v" if kind == "weight_norm" else "weight_orig"
            return (
                f"computed weight ({kind}: weight is recomputed from {source} before each forward, "
                f"so its gradient is not the layer's; remove the reparametrization or skip the layer)"
            )
    return None


def structure(model: nn.Module) -> tuple[tuple[object, ...], ...]:
    """What registration depends on beyond ``requires_grad``: each module of a registered type or with a
    lazy parameter, by name, with the identity of the module and of its weight parameter (or the kind of
    computed weight it has) and the weight's dtype. Cheap enough to compare at every ``step()``: a pruned,
    replaced, materialised (lazy) or converted (``.double()``) layer changes it."""
    out = []
    known: dict[type, bool] = {}  # class -> has a handler (one MRO walk per class, not per module)
    for name, module in model.named_modules():
        own = module._parameters.get("weight")
        lazy = isinstance(own, nn.parameter.UninitializedParameter)
        cls = type(module)
        if cls not in known:
            known[cls] = handler_for(module) is not None
        if not lazy and not known[cls] and not isinstance(module, nn.MultiheadAttention):
            continue
        weight = getattr(module, "weight", None)
        ident: object = id(own) if isinstance(own, nn.Parameter) else type(weight).__name__
        dtype = getattr(weight, "dtype", None) if not lazy else None
        out.append((name, id(module), type(module).__name__, ident, lazy, str(dtype)))
    return tuple(out)


def _weight_reason(weight: torch.Tensor) -> str | None:
    if isinstance(weight, nn.parameter.UninitializedParameter):
        return (
            "lazy uninitialised (its weight has no shape until the first forward; registered at the "
            "step after it)"
        )
    if not isinstance(weight, nn.Parameter):
        return "unsupported config (weight is not a Parameter: parametrized?)"
    if not weight.is_floating_point():
        return f"unsupported config (weight dtype {weight.dtype})"
    return None


def log_scan(scan: ModelScan, coverage: Coverage) -> None:
    """One line per set of tied weights, one coverage line, one warning below the coverage threshold."""
    reported: set[frozenset[str]] = set()
    for name, others in scan.tied.items():
        holders = frozenset([name, *others])
        if holders in reported:
            continue
        reported.add(holders)
        logger.warning(
            "K-FAC: tied weights: %s hold the same parameter; left out (plain gradient): %s",
            ", ".join(repr(n) for n in sorted(holders)),
            ", ".join(repr(n) for n in sorted(holders) if n in scan.tied),
        )
    logger.info("%s", coverage)
    why: dict[str, list[str]] = {}
    for key in ("unsupported_type", "not_a_weight_matrix"):
        for name in scan.left_out.get(key, ()):
            if name in scan.details:
                why.setdefault(scan.details[name], []).append(name or "(root)")
    for reason, names in why.items():
        logger.info("K-FAC: left out (plain gradient) %s: %s", ", ".join(names), reason)
    if coverage.below_threshold:
        logger.warning(
            "K-FAC covers only %.1f%% of the parameters in weight matrices/kernels (threshold %.0f%%): "
            "%s",
            100 * coverage.eligible_share,
            100 * coverage.threshold,
            _advice(coverage),
        )


def _advice(coverage: Coverage) -> str:
    """What to do about a coverage below the threshold, for what was left out."""
    if "lazy_uninitialised" in coverage.left_out:
        return "Lazy modules are registered at the step after their first forward (or run one forward first)"
    if "skipped_by_rule" in coverage.left_out:
        return (
            "skip_layers leaves layers out: if that is intended, lower coverage_threshold (or revise "
            "skip_layers)"
        )
    left = coverage.left_out
    if "unsupported_type" in left or "subclass_own_forward" in left:
        return (
            "register the model's layer types with kfac_bench.kfac.register_layer_type (docs/engine.md, "
            "'Your own layer') or revise skip_layers"
        )
    return (
        "what is left out has no K-FAC block the engine can compute (reasons above); lower "
        "coverage_threshold if that is expected"
    )
