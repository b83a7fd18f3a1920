"""kfac-pytorch as the overhead benchmark's reference arm (``benchmarks.overhead --reference PATH``).

:func:`reference_factory` imports kfac-pytorch from its source tree; the :class:`Reference` it returns builds
kfac-pytorch's preconditioner for one of the benchmark's arms from our engine's arguments, mapped onto its
constructor (:meth:`Reference.arguments`), and says what it could not match, so the benchmark can print it
under the reference's row. Both the current API (``kfac.preconditioner.KFACPreconditioner``, KAISA,
kfac-pytorch 0.4+) and the SC20-era ``kfac.KFAC`` are supported.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.training_step import Workload
from kfac_bench.kfac import KFACPreconditioner, parse_grad_worker_fraction
from kfac_bench.kfac.preconditioner import resolve_dtypes

#: Our engine's arguments that kfac-pytorch's ``KFACPreconditioner`` takes under the same name, meaning and
#: values (enum options as their lower-case names, which it accepts as strings).
_REFERENCE_SAME = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
    "accumulation_steps",
    "compute_eigenvalue_outer_product",
    "colocate_factors",
    "assignment_strategy",
    "symmetry_aware",
    "allreduce_bucket_cap_mb",
)
#: Our engine's arguments kfac-pytorch has no counterpart for, with the value that is its fixed behaviour:
#: an arm with another value is reported as not matched.
_REFERENCE_FIXED: dict[str, Any] = {
    "factor_scaling": "kaisa",  # its get_cov: mean over all rows, conv A and G divided by positions
    "placement": "lpt",
    "factor_reduction": "allreduce",
    "factor_batch_fraction": 1.0,
    "factor_position_fraction": 1.0,
    "comm_dtype": None,
    "process_group": None,
}
#: Our engine's arguments that change nothing the reference arm could mirror here: instrumentation, a
#: construction-time warning, the batch dimension only ``factor_scaling='per_example'`` reads, the
#: low-rank method's knobs (an ``eigen_lowrank`` arm is reported through ``compute_method``).
_REFERENCE_IRRELEVANT = (
    "track_stage_times",
    "coverage_threshold",
    "batch_dim",
    "lowrank_fraction",
    "lowrank_min_dim",
    "grad_scaler",
)
#: The SC20-era ``kfac.KFAC``'s fixed behaviour: its factors split the Kronecker product of ours
#: (``'per_example'``) differently, which the eigen method does not see; it places layers round-robin.
_LEGACY_FIXED = {**_REFERENCE_FIXED, "factor_scaling": "per_example", "placement": "round_robin"}
_STRATEGY_FRACTIONS = {"comm_opt": 1.0, "hybrid_opt": 0.5, "mem_opt": 0.0}  # its 0: 1/world size


def _plain(value: Any) -> Any:
    """An option enum as its plain string value (kfac-pytorch parses strings, not our enums)."""
    return str(value.value) if isinstance(value, enum.Enum) else value


def engine_defaults() -> dict[str, Any]:
    """Our ``KFACPreconditioner``'s keyword arguments and their defaults."""
    params = inspect.signature(KFACPreconditioner).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


@dataclass
class Reference:
    """kfac-pytorch imported from its source tree: builds its preconditioner for one of our arms.

    ``reference(model, engine_arguments, grad_scaler)`` builds it with our engine's arguments mapped onto
    its own (:meth:`arguments`). The current API is ``kfac.preconditioner.KFACPreconditioner`` (KAISA,
    kfac-pytorch 0.4+); the SC20-era ``kfac.KFAC`` (``legacy``) takes the cadence, damping, decay, KL clip
    and lr only.
    """

    path: str
    cls: Any
    legacy: bool = False

    def arguments(
        self, model: nn.Module, a: dict[str, Any], grad_scaler: Any = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """kfac-pytorch's constructor arguments for our engine arguments ``a`` (our defaults filling the
        rest), and what could not be matched (``{name: 'ours X, reference Y'}``).

        The mapping (current API), besides the names both take alike (:data:`_REFERENCE_SAME`):
        ``compute_method`` ``'eigen'``/``'inverse'`` as is (``'eigen_lowrank'`` has no counterpart: the
        reference runs ``'eigen'``); ``grad_worker_fraction`` as the number it stands for (``comm_opt`` 1,
        ``hybrid_opt`` 0.5, ``mem_opt`` 0 = 1/world, as kfac-pytorch reads 0); ``factor_dtype`` and
        ``inv_dtype`` as ours resolves them for ``model`` (:func:`resolve_dtypes`: float32 for a float32 or
        low-precision model), so both store factors and decompositions alike (the reference always runs
        ``eigh``/``inv`` in float32 and casts to ``inv_dtype``; ours decomposes in ``inv_dtype``);
        ``skip_layers`` as a list (both ``re.search`` the qualified name and the class name);
        ``grad_scaler`` as its ``get_scale`` (kfac-pytorch recognises only ``torch.cuda.amp.GradScaler``,
        and takes any callable returning the scale). Its own ``update_factors_in_hook=True`` (factors
        computed in the module hooks, during forward and backward) and ``loglevel`` keep their defaults.
        Our arguments it has no counterpart for must hold its fixed behaviour (:data:`_REFERENCE_FIXED`),
        else they are reported: ``factor_scaling`` always is (ours defaults to ``'expand'``, the
        reference's ``get_cov`` is our ``'kaisa'``, the SC20-era code's our ``'per_example'``; a scalar per
        factor, the same FLOPs).
        """
        ours = {**engine_defaults(), **a}
        unmatched: dict[str, str] = {}
        for name, fixed in (_LEGACY_FIXED if self.legacy else _REFERENCE_FIXED).items():
            if ours.get(name) != fixed:
                unmatched[name] = f"ours {_plain(ours.get(name))!r}, reference {fixed!r}"
        unknown = sorted(
            set(a)
            - set(_REFERENCE_SAME)
            - set(_REFERENCE_FIXED)
            - set(_REFERENCE_IRRELEVANT)
            - {"compute_method", "grad_worker_fraction", "factor_dtype", "inv_dtype", "skip_layers"}
        )
        for name in unknown:
            unmatched[name] = f"ours {_plain(a[name])!r}, reference has no such argument"
        if self.legacy:
            taken = {
                "factor_update_steps",
                "inv_update_steps",
                "damping",
                "lr",
                "factor_decay",
                "kl_clip",
            }
            defaults = engine_defaults()
            for name in sorted(set(a) - taken - set(_LEGACY_FIXED) - set(_REFERENCE_IRRELEVANT)):
                if a[name] != defaults.get(name):
                    unmatched.setdefault(
                        name, f"ours {_plain(a[name])!r}, kfac.KFAC takes no {name}"
                    )
            return {
                "lr": ours["lr"],
                "factor_decay": ours["factor_decay"],
                "damping": ours["damping"],
                "kl_clip": ours["kl_clip"],
                "fac_update_freq": ours["factor_update_steps"],
                "kfac_update_freq": ours["inv_update_steps"],
            }, unmatched
        kwargs = {name: _plain(ours[name]) for name in _REFERENCE_SAME}
        method = _plain(ours["compute_method"])
        if method not in ("eigen", "inverse"):
            unmatched["compute_method"] = f"ours {method!r}, reference 'eigen'"
            method = "eigen"
        kwargs["compute_method"] = method
        fraction = parse_grad_worker_fraction(ours["grad_worker_fraction"])
        kwargs["grad_worker_fraction"] = (
            fraction if isinstance(fraction, float) else _STRATEGY_FRACTIONS[_plain(fraction)]
        )
        kwargs["factor_dtype"], kwargs["inv_dtype"] = resolve_dtypes(
            model, ours["factor_dtype"], ours["inv_dtype"]
        )
        kwargs["skip_layers"] = list(ours["skip_layers"])
        if grad_scaler is not None:
            kwargs["grad_scaler"] = grad_scaler.get_scale
        return kwargs, unmatched

    def __call__(self, model: nn.Module, a: dict[str, Any], grad_scaler: Any = None) -> Any:
        kwargs, _ = self.arguments(model, a, grad_scaler)
        return self.cls(model, **kwargs)


def out_of_place(model: nn.Module) -> int:
    """Turn off ``inplace`` in ``model``'s modules (``nn.ReLU(inplace=True)`` and the like); how many."""
    changed = 0
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False  # type: ignore[assignment]
            changed += 1
    return changed


def arm_models(w: Workload, reference: bool) -> tuple[nn.Module, Callable[[], nn.Module], int]:
    """The arms' models: ``w``'s model built under seed 0, a factory of copies with its weights, and how
    many in-place activations are off in each. With the ``reference``, every arm runs the model with
    in-place activations off (kfac-pytorch's full backward hooks forbid in-place ops on a hooked module's
    output), so all arms run the same model."""
    torch.manual_seed(0)
    base = w.build()
    in_place_off = out_of_place(base) if reference else 0
    state = base.state_dict()

    def copy() -> nn.Module:
        m = w.build()
        m.load_state_dict(state)
        if in_place_off:
            out_of_place(m)
        return m

    return base, copy, in_place_off


def _source_version(path: str) -> str:
    """The version a kfac-pytorch source tree at ``path`` declares (``version`` in the ``[project]`` table
    of its ``pyproject.toml``), ``'0+source'`` where it declares none (a ``setuptools_scm`` checkout)."""
    try:
        with open(os.path.join(path, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "0+source"
    table = re.search(r"^\[project\][ \t]*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = table and re.search(r"^version\s*=\s*[\"']([^\"']+)[\"']", table.group(1), re.M)
    return found.group(1) if found else "0+source"


@contextlib.contextmanager
def _source_metadata(path: str) -> Iterator[None]:
    """While open, ``importlib.metadata`` finds a ``kfac-pytorch`` distribution of the version the source tree
    at ``path`` declares: kfac-pytorch's ``__init__`` reads its own installed version, which a plain
    checkout (``git clone``) does not have. Nothing is installed: the metadata lives in a temporary folder
    on ``sys.path`` only for the import."""
    version = _source_version(path)
    with tempfile.TemporaryDirectory(prefix="kfac-pytorch-metadata-") as tmp:
        info = os.path.join(tmp, f"kfac_pytorch-{version}.dist-info")
        os.mkdir(info)
        with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
            f.write(f"Metadata-Version: 2.1\nName: kfac-pytorch\nVersion: {version}\n")
        sys.path.append(tmp)
        try:
            yield
        finally:
            sys.path.remove(tmp)


def _forget_kfac() -> None:
    for name in [m for m in sys.modules if m == "kfac" or m.startswith("kfac.")]:
        del sys.modules[name]


def _import_kfac(path: str) -> Any:
    """kfac-pytorch's ``kfac`` package from the source tree at ``path`` (with ``kfac.preconditioner``
    where it has one); a tree whose ``__init__`` reads its installed version imports as it would once
    installed (:func:`_source_metadata`)."""
    try:
        ref = importlib.import_module("kfac")
    except importlib.metadata.PackageNotFoundError as err:
        if err.name != "kfac-pytorch":
            raise
        _forget_kfac()
        with _source_metadata(path):
            ref = importlib.import_module("kfac")
    with contextlib.suppress(ImportError):
        importlib.import_module("kfac.preconditioner")
    return ref


def reference_factory(path: str) -> Reference:
    """kfac-pytorch imported from its source tree at ``path`` (the directory holding its ``kfac``
    package, e.g. a ``git clone`` of gpauloski/kfac-pytorch; it need not be installed): the current API
    (``kfac.preconditioner.KFACPreconditioner``) or the SC20-era one (``kfac.KFAC``). A ``kfac`` imported
    before (an installed kfac-pytorch) is set aside for it.

    Raises:
        SystemExit: one line, when no ``kfac`` package with either class is importable from ``path``.
    """
    _forget_kfac()
    sys.path.insert(0, path)
    try:
        ref = _import_kfac(path)
    except importlib.metadata.PackageNotFoundError as err:
        raise SystemExit(
            f"--reference {path}: its kfac package reads the version of an installed {err.name}; "
            f"install that tree without dependencies (pip install --no-deps -e {path})"
        ) from None
    except ImportError as err:
        raise SystemExit(
            f"--reference {path}: cannot import kfac-pytorch from there ({err}); give its source root"
        ) from None
    current = getattr(getattr(ref, "preconditioner", None), "KFACPreconditioner", None)
    if current is not None:
        return Reference(path, current)
    legacy = getattr(ref, "KFAC", None)
    if legacy is None:
        raise SystemExit(
            f"--reference {path}: its kfac package has neither preconditioner.KFACPreconditioner nor KFAC"
        )
    return Reference(path, legacy, legacy=True)
