"""Compute ops per training step, by K-FAC stage: SGD, our engine and the reference, side by side.

Run ``python -m benchmarks.ops [--workloads resnet32 bert] [--reference PATH]`` (``make bench`` prints the
same table after the timing one). On a GPU every compute op is a kernel launch, several microseconds of host
time however small the tensor, so on small models the op count, not the FLOPs, sets K-FAC's overhead there.

What is counted (``torch.profiler``, CPU activity): *leaf* ``aten::`` ops (no ``aten::`` op below them) that
are neither views nor pure allocations. A view is an op whose schema returns an alias of an input without
writing it (``view``, ``transpose``, ``expand``; ``to``/``contiguous``/``reshape`` when they return their
input: when they copy, the copy below them is counted instead); allocations (``empty``, ``empty_like``,
``empty_strided``, ``new_empty``) launch no kernel. A ``torch._foreach_*`` op counts once: on CUDA it is
one multi-tensor launch (the CPU runs it as a loop, which is not counted).

Each arm (a copy of the model with SGD; the same with our ``KFACPreconditioner``; with ``--reference``,
kfac-pytorch's) runs ``--warmup`` steps (first-call costs, the first decomposition), then ``--steps`` profiled
steps at the workload's cadence (factors every step, a decomposition every 10 by default), all on the same
batches; counts are means per step. Our engine marks its stages as ``kfac::<stage>`` profiler ranges
(:class:`kfac_bench.kfac.timing.StageTimer`); the reference's layer methods are wrapped in the same ranges
(:data:`REFERENCE_STAGES`). Ops in ``precond.step()`` outside any stage are *step, other*; ops outside
``precond.step()`` and outside stages (the model's forward and backward, the optimizer) are *model + SGD*.
The extra ops of an arm are its total minus the SGD arm's.

With CUDA (``--device cuda``) the CUDA kernels the profiler saw are counted too, with their device time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent

from benchmarks.kfac_pytorch_reference import arm_models, reference_factory
from benchmarks.training_step import Arm, Setup, Workload, kfac_arguments
from kfac_bench.kfac import batching
from kfac_bench.kfac.layers import conv_batched

#: Report rows: the engine's stages grouped as the table shows them.
STAGE_ROWS = {
    "factor": "factors",
    "factor_comm": "factors",
    "decomposition": "decompositions",
    "decomposition_comm": "decompositions",
    "precondition": "preconditioning",
    "grad_broadcast": "preconditioning",
    "kl_clip": "KL clip",
}
ROWS = ("model + SGD", "factors", "decompositions", "preconditioning", "KL clip", "step, other")
#: kfac-pytorch's layer and preconditioner methods and the stage each one's ops belong to (wrapped in
#: ``kfac::<stage>`` ranges when present; names the reference lacks are skipped).
REFERENCE_STAGES = {
    "save_layer_input": "factor",
    "save_layer_grad_output": "factor",
    "update_a_factor": "factor",
    "update_g_factor": "factor",
    "reduce_a_factor": "factor_comm",
    "reduce_g_factor": "factor_comm",
    "compute_a_inv": "decomposition",
    "compute_g_inv": "decomposition",
    "broadcast_a_inv": "decomposition_comm",
    "broadcast_g_inv": "decomposition_comm",
    "preconditioned_grad": "precondition",
    "broadcast_grad": "grad_broadcast",
    "_compute_grad_scale": "kl_clip",
    "update_grad": "kl_clip",
}
#: Ops that launch no kernel: allocations, metadata changes, dtype arithmetic.
_NO_KERNEL = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "resize_as_",
        "as_strided_",
        "set_",
        "detach_",
        # in-place metadata changes: new sizes and strides on the same storage (kfac-pytorch's conv
        # patches are ``unfold(...).transpose_(1, 2).transpose_(2, 3).contiguous()``: one copy)
        "transpose_",
        "t_",
        "swapdims_",
        "swapaxes_",
        "squeeze_",
        "unsqueeze_",
        "_unsafe_view",
        "_reshape_alias",
        "promote_types",
        "result_type",
    }
)
_STEP = "kfac::step()"
#: What the op tables count, printed under them.
LEGEND = (
    "ops: leaf aten ops that are neither views nor allocations (a torch._foreach_* op once), mean per step "
    "of profiled steps at the cadence; extra = the arm's total minus SGD's"
)


@functools.cache
def is_view(op: str) -> bool:
    """Whether ``aten::op`` returns an alias of an input without writing it in every overload."""
    schemas = [
        s
        for s in torch._C._jit_get_schemas_for_operator(f"aten::{op}")
        if s.returns and "Tensor" in str(s.returns[0].type)
    ]
    if not schemas:
        return False
    for schema in schemas:
        rets = schema.returns
        if not rets:
            return False
        info = rets[0].alias_info
        if info is None or info.is_write:
            return False
    return True


def counted(name: str) -> bool:
    """Whether a leaf event named ``name`` is a compute op (module docstring)."""
    if not name.startswith("aten::"):
        return False
    op = name[len("aten::") :]
    return op not in _NO_KERNEL and not is_view(op)


def _row(event: FunctionEvent) -> str:
    """The report row an op belongs to: its innermost ``kfac::`` range."""
    parent = event.cpu_parent
    in_step = False
    while parent is not None:
        if parent.name.startswith("kfac::"):
            if parent.name == _STEP:
                in_step = True
            else:
                return STAGE_ROWS[parent.name[len("kfac::") :]]
        parent = parent.cpu_parent
    return "step, other" if in_step else "model + SGD"


def _foreach_below(event: FunctionEvent) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::_foreach_"):
            return True
        parent = parent.cpu_parent
    return False


def count_ops(events: list[FunctionEvent]) -> tuple[dict[str, int], collections.Counter[str]]:
    """Compute ops per report row, and per op name (module docstring for what counts)."""
    rows: dict[str, int] = dict.fromkeys(ROWS, 0)
    names: collections.Counter[str] = collections.Counter()
    below: dict[int, bool] = {}

    def counts_below(e: FunctionEvent) -> bool:
        """Whether a counted op lies below ``e`` (then ``e`` is not a leaf)."""
        if id(e) not in below:
            below[id(e)] = any(counted(c.name) or counts_below(c) for c in e.cpu_children)
        return below[id(e)]

    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not counted(e.name):
            continue
        foreach = e.name.startswith("aten::_foreach_")
        if not foreach and counts_below(e):
            continue
        if _foreach_below(e):
            continue
        rows[_row(e)] += 1
        names[e.name[len("aten::") :]] += 1
    return rows, names


def count_kernels(events: list[FunctionEvent]) -> tuple[int, float]:
    """CUDA kernels in a profile and their summed device time (seconds)."""
    n, us = 0, 0.0
    for e in events:
        for k in getattr(e, "kernels", ()):
            n += 1
            us += k.duration
    return n, us * 1e-6


@contextlib.contextmanager
def _labelled_reference(precond: Any) -> Iterator[None]:
    """Wrap the reference's stage methods (:data:`REFERENCE_STAGES`) in ``kfac::`` ranges."""
    targets = [precond]
    layers = getattr(precond, "_layers", {}) or {}
    for v in layers.values():
        targets += [x for x in (v if isinstance(v, tuple) else (v,)) if not isinstance(x, str)]
    saved: list[tuple[Any, str]] = []
    for obj in targets:
        for meth, stage in REFERENCE_STAGES.items():
            fn = getattr(obj, meth, None)
            if not callable(fn):
                continue

            def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _s: str = stage, **k: Any) -> Any:
                with torch.profiler.record_function(f"kfac::{_s}"):
                    return _fn(*a, **k)

            setattr(obj, meth, wrapped)
            saved.append((obj, meth))
    try:
        yield
    finally:
        for obj, meth in saved:
            with contextlib.suppress(AttributeError):
                delattr(obj, meth)


class _Labelled:
    """An arm's preconditioner whose ``step()`` runs inside the ``kfac::step()`` range."""

    def __init__(self, precond: Any) -> None:
        self.precond = precond

    def step(self) -> None:
        with torch.profiler.record_function(_STEP):
            self.precond.step()


def measure(
    w: Workload,
    *,
    factor_steps: int = 1,
    inv_steps: int = 10,
    steps: int = 10,
    warmup: int = 3,
    setup: Setup | None = None,
    reference: Callable[[nn.Module, dict[str, Any], Any], Any] | None = None,
    variant: dict[str, Any] | None = None,
    rules: str | None = None,
) -> dict[str, Any]:
    """Mean compute ops per step of each arm (``sgd``, ``ours``, ``reference``) by report row and by op name,
    their extra over SGD, and with CUDA the kernels and their device time. ``rules``: count our engine
    with the choices of that device type (:func:`_rules_of`)
    while running here, e.g. ``'cuda'`` on the CPU: the ops a GPU would launch."""
    with _rules_of(rules, setup.device_type if setup else "cpu"):
        return _measure(w, factor_steps, inv_steps, steps, warmup, setup, reference, variant, rules)


@contextlib.contextmanager
def _rules_of(device_type: str | None, here: str) -> Iterator[None]:
    """Our engine's per-device choices of ``device_type`` on device type ``here`` for a while: whether
    same-shaped calls are held for one batch (:data:`kfac_bench.kfac.batching.HOLD`) and the conv
    kernel of a batch (:data:`kfac_bench.kfac.layers.conv_batched.RULES`)."""
    if device_type is None:
        yield
        return
    rules, hold = dict(conv_batched.RULES), dict(batching.HOLD)
    conv_batched.RULES[here] = conv_batched.RULES.get(device_type, "unfold")
    batching.HOLD[here] = batching.HOLD.get(device_type, True)
    try:
        yield
    finally:
        conv_batched.RULES.clear()
        conv_batched.RULES.update(rules)
        batching.HOLD.clear()
        batching.HOLD.update(hold)


def _measure(
    w: Workload,
    factor_steps: int,
    inv_steps: int,
    steps: int,
    warmup: int,
    setup: Setup | None,
    reference: Callable[[nn.Module, dict[str, Any], Any], Any] | None,
    variant: dict[str, Any] | None,
    rules: str | None,
) -> dict[str, Any]:
    setup = setup or Setup()
    base, copy, _ = arm_models(w, reference is not None)
    args = kfac_arguments(
        w, factor_update_steps=factor_steps, inv_update_steps=inv_steps, **(variant or {})
    )
    arms = {"sgd": Arm(base, setup, None), "ours": Arm(copy(), setup, args)}
    if reference is not None:
        arms["reference"] = Arm(copy(), setup, None, factory=lambda m, s: reference(m, args, s))
    g = torch.Generator().manual_seed(1)
    batches = [setup.to_device(w.batch(g)) for _ in range(warmup + steps)]
    out: dict[str, Any] = {
        "rules": rules or setup.device_type,
        "workload": w.name,
        "steps": steps,
        "cadence": f"{factor_steps}/{inv_steps}",
    }
    acts = [torch.profiler.ProfilerActivity.CPU]
    if setup.device_type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    arms_out = {}
    for name, arm in arms.items():
        for b in batches[:warmup]:
            arm.step(w, b)
        real = arm.precond
        if real is not None:
            arm.precond = _Labelled(real)
        label = _labelled_reference(real) if name == "reference" else contextlib.nullcontext()
        with label, torch.profiler.profile(activities=acts) as prof:
            for b in batches[warmup:]:
                arm.step(w, b)
        arm.precond = real
        events = list(prof.events())
        rows, names = count_ops(events)
        entry: dict[str, Any] = {
            "rows": {k: v / steps for k, v in rows.items()},
            "total": sum(rows.values()) / steps,
            "ops": {k: v / steps for k, v in names.most_common()},
        }
        if setup.device_type == "cuda":
            n, secs = count_kernels(events)
            entry["cuda_kernels"], entry["cuda_kernel_s"] = n / steps, secs / steps
        arms_out[name] = entry
    sgd = arms_out["sgd"]
    for entry in arms_out.values():
        entry["extra"] = entry["total"] - sgd["total"]
        entry["extra_ops"] = {
            k: v - sgd["ops"].get(k, 0.0)
            for k, v in entry["ops"].items()
            if v - sgd["ops"].get(k, 0.0) > 0
        }
    kfac = arms["ours"].precond
    out["layers"] = len(getattr(kfac, "layers", {}))
    out["arms"] = arms_out
    return out


def table(r: dict[str, Any], top: int = 8) -> str:
    """The op table of one workload: rows by stage, one column per arm, extra over SGD, top extra ops."""
    arms = list(r["arms"])
    lines = [
        f"{r['workload']}: compute ops per step (mean of {r['steps']} steps, cadence {r['cadence']}, "
        f"{r['layers']} K-FAC layers, our kernel choices of {r.get('rules', 'this device')})"
    ]
    head = f"  {'ops per step':<18}" + "".join(f"{a:>12}" for a in arms)
    lines += [head, "  " + "-" * (len(head) - 2)]
    for row in ROWS:
        lines.append(f"  {row:<18}" + "".join(f"{r['arms'][a]['rows'][row]:>12.1f}" for a in arms))
    lines.append("  " + "-" * (len(head) - 2))
    lines.append(f"  {'total':<18}" + "".join(f"{r['arms'][a]['total']:>12.1f}" for a in arms))
    lines.append(
        f"  {'extra over SGD':<18}" + "".join(f"{r['arms'][a]['extra']:>12.1f}" for a in arms)
    )
    layers = r.get("layers") or 0
    if layers:
        lines.append(
            f"  {'extra per layer':<18}"
            + "".join(f"{r['arms'][a]['extra'] / layers:>12.1f}" for a in arms)
        )
    if "reference" in r["arms"] and r["arms"]["reference"]["extra"] > 0:
        ratio = r["arms"]["ours"]["extra"] / r["arms"]["reference"]["extra"]
        lines.append(f"  ours / reference extra ops: {ratio:.2f}")
    if "cuda_kernels" in r["arms"]["sgd"]:
        lines.append(
            f"  {'CUDA kernels':<18}"
            + "".join(f"{r['arms'][a]['cuda_kernels']:>12.1f}" for a in arms)
        )
        lines.append(
            f"  {'kernel ms':<18}"
            + "".join(f"{r['arms'][a]['cuda_kernel_s'] * 1e3:>12.2f}" for a in arms)
        )
    for a in arms[1:]:
        extra = sorted(r["arms"][a]["extra_ops"].items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"  {a} extra by op: " + ", ".join(f"{k} {v:.0f}" for k, v in extra))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.ops", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--workloads", nargs="+", default=["resnet32", "bert"])
    ap.add_argument("--steps", type=int, default=10, help="profiled steps per arm")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cadence", default="1/10", help="factor/decomposition intervals")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--rules",
        help="count our engine with this device type's kernel choices (e.g. cuda on the CPU)",
    )
    ap.add_argument("--reference", metavar="PATH", help="kfac-pytorch source root: add its arm")
    ap.add_argument("--json", help="write the results here as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    from benchmarks.overhead import workload

    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    reference = reference_factory(args.reference) if args.reference else None
    f, k = (int(v) for v in args.cadence.split("/"))
    rows = []
    for name in args.workloads:
        print(f"counting ops of {name} ...", file=sys.stderr, flush=True)
        r = measure(
            workload(name),
            factor_steps=f,
            inv_steps=k,
            steps=args.steps,
            warmup=args.warmup,
            setup=Setup(device=args.device),
            reference=reference,
            rules=args.rules,
        )
        rows.append(r)
        print(table(r) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"meta": {"torch": torch.__version__, "device": args.device}, "results": rows},
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
