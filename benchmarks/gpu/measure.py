"""The GPU check's measurements: amortised K-FAC step time by step kind, conv-factor dispatch, memory.

Amortisation without running a whole decomposition interval: the K-FAC arm runs with factors every 2 and
decompositions every 4 steps, so every window of 4 steps holds one step of each *kind*:

* ``decomposition``: factors and decompositions (step 0 of the window),
* ``factor``: factors only (step 2),
* ``plain``: neither, only preconditioning with the cached decompositions and KL clipping (steps 1, 3).

Each kind's time is the median over the measured windows (both arms take turns on the same batches, as in
``benchmarks/overhead.py``). For factor interval ``f`` and decomposition interval ``k`` (``f`` divides
``k``), an interval of ``k`` steps holds 1 decomposition step, ``k/f − 1`` factor steps and ``k − k/f``
plain steps, so the time per step at that cadence is ``report.FORMULA``; stage times and the SGD arm
are combined the same way.

The check's ``resnet50``, ``bert_large`` and ``memory`` steps (:func:`resnet50`, :func:`bert_large`,
:func:`memory`) run these measurements on one device (tiny sizes on the CPU in a dry run).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from benchmarks.conv_factor import ConvShape
from benchmarks.gpu.report import CADENCES, MEASURING_CADENCE
from benchmarks.training_step import (
    Arm,
    Setup,
    StepTime,
    Workload,
    bert_workload,
    classification,
    eigh_check,
    kfac_arguments,
    twins,
)
from kfac_bench.kfac import STAGES
from kfac_bench.kfac.layers.conv_shift import conv2d_a_factor_shift
from kfac_bench.kfac.layers.conv_unfold import conv2d_a_factor, conv2d_a_factor_unfold, fast_method

if TYPE_CHECKING:
    from benchmarks.gpu.check import StepContext

KINDS = ("decomposition", "factor", "plain")
#: Two dispatch paths closer than this are a tie: either choice is right (both methods are exact).
DISPATCH_TIE = 0.10


def step_kind(step: int) -> str:
    """The kind of step ``step`` of the measuring run (:data:`MEASURING_CADENCE`)."""
    f, k = MEASURING_CADENCE
    return "decomposition" if step % k == 0 else "factor" if step % f == 0 else "plain"


def amortise(per_kind: dict[str, float], factor_steps: int, inv_steps: int) -> float:
    """Seconds per step at cadence ``factor_steps / inv_steps`` from per-kind seconds
    (``report.FORMULA``)."""
    if factor_steps < 1 or inv_steps % factor_steps != 0:
        raise ValueError(
            f"the factor interval must divide the decomposition interval: {factor_steps}/{inv_steps}"
        )
    per_interval = inv_steps // factor_steps
    return (
        per_kind["decomposition"]
        + (per_interval - 1) * per_kind["factor"]
        + (inv_steps - per_interval) * per_kind["plain"]
    ) / inv_steps


def _kind_medians(steps: list[tuple[str, StepTime, StepTime]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [(s, k) for knd, s, k in steps if knd == kind]
        med = statistics.median
        out[kind] = {
            "count": len(mine),
            "sgd_step_s": med(s.total for s, _ in mine),
            "kfac_step_s": med(k.total for _, k in mine),
            "sgd_forward_backward_s": med(s.forward_backward for s, _ in mine),
            "kfac_forward_backward_s": med(k.forward_backward for _, k in mine),
            "kfac_precondition_call_s": med(k.precondition for _, k in mine),
            "stages_s": {st: med(k.stages[st] for _, k in mine) for st in STAGES},
        }
    return out


def cadence_row(
    kinds: dict[str, dict[str, Any]], factor_steps: int, inv_steps: int
) -> dict[str, Any]:
    """SGD and K-FAC seconds per step, ratio and per-stage seconds per step at one cadence."""

    def am(get: Callable[[dict[str, Any]], float]) -> float:
        return amortise({k: get(v) for k, v in kinds.items()}, factor_steps, inv_steps)

    def stage_s(stage: str, v: dict[str, Any]) -> float:
        return v["stages_s"][stage]

    sgd, kfac = am(lambda v: v["sgd_step_s"]), am(lambda v: v["kfac_step_s"])
    return {
        "factor_update_steps": factor_steps,
        "inv_update_steps": inv_steps,
        "sgd_step_s": sgd,
        "kfac_step_s": kfac,
        "ratio": kfac / sgd,
        "stages_s_per_step": {st: am(functools.partial(stage_s, st)) for st in STAGES},
        # The engine times the factor work inside its forward/backward hooks on the host only (no device
        # synchronisation per layer); the device cost of that work shows as the K-FAC arm's longer
        # forward + backward, measured here against the SGD arm on the same batch.
        "factor_hooks_s_per_step": am(
            lambda v: v["kfac_forward_backward_s"] - v["sgd_forward_backward_s"]
        ),
    }


def side_by_side(
    w: Workload,
    setup: Setup,
    cadences: list[tuple[int, int]],
    windows: int,
    deadline: float,
    record: Callable[[str, Any], None],
    eigh_repeats: int = 3,
) -> Any:
    """Per-kind step times of both arms, each cadence's amortised row and the decomposition-vs-eigh check,
    recorded as they are known. Stops adding windows when the next one would pass ``deadline`` (at least
    one is measured). Returns the K-FAC arm's preconditioner."""
    f, k = MEASURING_CADENCE
    sgd, kfac = twins(w, setup, factor_update_steps=f, inv_update_steps=k)
    p = kfac.precond
    assert p is not None
    record("layers", len(p.layers))
    g = torch.Generator().manual_seed(1)
    batches = [
        setup.to_device(w.batch(g)) for _ in range(k)
    ]  # made once: no data cost in the timings
    t0 = time.perf_counter()
    # The warm-up window: first calls, allocator, cuDNN autotuning, the first decomposition.
    for b in batches:
        sgd.step(w, b)
        kfac.step(w, b)
    window_s = time.perf_counter() - t0
    record("warmup_window_s", window_s)
    # Under autocast the engine should still keep float32 factors (KFACPreconditioner's factor_dtype).
    dtypes = {
        str(f.dtype) for s in p.layers.values() for f in (s.a_factor, s.g_factor) if f is not None
    }
    record("factor_dtypes", sorted(dtypes))
    steps: list[tuple[str, StepTime, StepTime]] = []
    measured = 0
    while measured < windows and (measured == 0 or time.monotonic() + window_s < deadline):
        t0 = time.perf_counter()
        for i, b in enumerate(batches):
            steps.append((step_kind(i), sgd.step(w, b), kfac.step(w, b)))
        window_s = time.perf_counter() - t0
        measured += 1
        kinds = _kind_medians(steps)
        record("windows", measured)
        record("per_kind", kinds)
        record("cadences", [cadence_row(kinds, cf, ck) for cf, ck in cadences])
    decomposition_s = kinds["decomposition"]["stages_s"]["decomposition"]
    repeats = eigh_repeats if time.monotonic() + eigh_repeats * decomposition_s < deadline else 1
    record("eigh_check", {**eigh_check(p, decomposition_s, repeats), "repeats": repeats})
    return p


# ------------------------------------------------------------------------------------------------ conv


def conv_shapes(model: nn.Module, image_size: int, batch: int) -> Counter[ConvShape]:
    """The model's Conv2d inputs at ``image_size``² (captured by forward hooks at batch 1, on the CPU)."""
    shapes: Counter[ConvShape] = Counter()

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], _: object) -> None:
        assert isinstance(module, nn.Conv2d)
        _n, c, h, w = inputs[0].shape
        p = module.padding
        if module.groups != 1 or h != w or isinstance(p, str) or len(set(p)) != 1:
            return  # not preconditioned, or not a shape ConvShape describes
        k, s = module.kernel_size[0], module.stride[0]
        shapes[ConvShape(batch, c, h, k, s, p[0], module.bias is not None)] += 1

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size))
    model.train(was_training)
    for h in handles:
        h.remove()
    return shapes


def _medians(fns: list[Callable[[], object]], repeats: int, setup: Setup) -> list[float]:
    """Median seconds of each callable, timed in turn (so all see the same machine load), the device
    synchronised around each call; one untimed round first."""

    def timed(fn: Callable[[], object]) -> float:
        setup.sync()
        t0 = time.perf_counter()
        fn()
        setup.sync()
        return time.perf_counter() - t0

    for fn in fns:
        timed(fn)
    times = [[timed(fn) for fn in fns] for _ in range(repeats)]
    return [statistics.median(col) for col in zip(*times)]


def conv_dispatch(
    shapes: Counter[ConvShape],
    setup: Setup,
    repeats: int,
    deadline: float,
    record: Callable[[str, Any], None],
) -> None:
    """Both A-factor paths (shift correlation, unfold + GEMM in one piece) and the dispatched call (which
    runs unfold in batch chunks) per conv shape, in float32 (the factor dtype) and the setup's memory
    format, and whether ``fast_method`` picked the faster path. Largest inputs first; stops at
    ``deadline`` (at least one shape)."""
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for shape, count in sorted(shapes.items(), key=lambda kv: -kv[0].channels * kv[0].size ** 2):
        if rows and time.monotonic() > deadline:
            break
        row: dict[str, Any] = {"layer": shape.label(), "count": count, "batch": shape.batch}
        try:
            x = torch.randn(shape.batch, shape.channels, shape.size, shape.size, generator=gen)
            x = setup.to_device(x)
            args = shape.args()
            shift_s, unfold_s, dispatched_s = _medians(
                [
                    functools.partial(conv2d_a_factor_shift, x, *args),
                    functools.partial(conv2d_a_factor_unfold, x, *args),
                    functools.partial(conv2d_a_factor, x, *args),  # what the engine runs
                ],
                repeats,
                setup,
            )
            chosen = fast_method(x, *args[:4])
            faster = "shift" if shift_s <= unfold_s else "unfold"
            tie = abs(shift_s - unfold_s) <= DISPATCH_TIE * min(shift_s, unfold_s)
            row.update(
                chosen=chosen,
                shift_ms=shift_s * 1e3,
                unfold_ms=unfold_s * 1e3,
                dispatched_ms=dispatched_s * 1e3,
                faster=faster,
                tie=tie,
                ok=tie or chosen == faster,
            )
            del x
        except RuntimeError as exc:  # e.g. out of memory for one shape: record it, go on
            row["error"] = str(exc).splitlines()[0][:200]
        rows.append(row)
        record("conv_dispatch", _dispatch_summary(rows, len(shapes)))


def _dispatch_summary(rows: list[dict[str, Any]], total_shapes: int) -> dict[str, Any]:
    timed = [r for r in rows if "error" not in r]
    chosen = sum(r["count"] * r[f"{r['chosen']}_ms"] for r in timed)
    best = sum(r["count"] * min(r["shift_ms"], r["unfold_ms"]) for r in timed)
    return {
        "shapes": total_shapes,
        "shapes_measured": len(rows),
        "shapes_failed": len(rows) - len(timed),
        "mismatches": [r["layer"] for r in timed if not r["ok"]],
        "tie_tolerance": DISPATCH_TIE,
        "network_chosen_ms": chosen,
        "network_best_ms": best,
        "network_ratio": chosen / best if best > 0 else None,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------- memory


def _allocated(setup: Setup) -> tuple[int | None, int | None]:
    """(bytes allocated now, peak bytes allocated since the last reset) on CUDA; (None, None) elsewhere."""
    if setup.device_type != "cuda":
        return None, None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def _release(setup: Setup) -> None:
    gc.collect()
    if setup.device_type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory_figures(
    w: Workload, setup: Setup, steps: int, record: Callable[[str, Any], None]
) -> None:
    """The engine's ``memory_usage()`` against the allocator: the K-FAC arm alone (after a step with factors
    and decompositions, then ``steps - 1`` more) minus the SGD arm alone after as many steps."""
    g = torch.Generator().manual_seed(1)
    batch = setup.to_device(w.batch(g))
    figures: dict[str, Any] = {}
    for name in ("sgd", "kfac"):
        _release(setup)
        base, _ = _allocated(setup)
        torch.manual_seed(0)
        kfac = kfac_arguments(w, factor_update_steps=10, inv_update_steps=100)
        arm = Arm(w.build(), setup, kfac if name == "kfac" else None)
        for _ in range(steps):  # step 0 computes factors and decompositions
            arm.step(w, batch)
        now, peak = _allocated(setup)
        figures[f"{name}_allocated_bytes"] = None if now is None else now - (base or 0)
        figures[f"{name}_peak_allocated_bytes"] = None if peak is None else peak - (base or 0)
        if arm.precond is not None:
            figures["engine_memory_usage"] = arm.precond.memory_usage()
            figures["layers"] = len(arm.precond.layers)
        del arm
    delta = _delta(figures, "allocated")
    engine = figures["engine_memory_usage"]["total"]
    figures.update(
        allocated_delta_bytes=delta,
        peak_delta_bytes=_delta(figures, "peak_allocated"),
        ratio=engine / delta if delta else None,
        steps=steps,
    )
    _release(setup)
    record("memory", figures)


def _delta(figures: dict[str, Any], what: str) -> int | None:
    a, b = figures[f"kfac_{what}_bytes"], figures[f"sgd_{what}_bytes"]
    return None if a is None or b is None else a - b


@contextlib.contextmanager
def cudnn_autotune(setup: Setup) -> Any:
    """cuDNN picks its fastest convolution algorithms (both arms alike), as training jobs do."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = setup.device_type == "cuda"
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


# ------------------------------------------------------------------------------------- collectives


def collective_probe(path: Path, dry: bool) -> int:
    """One torchrun rank: join the process group (NCCL on CUDA, gloo on the CPU), all-reduce and broadcast,
    check the values, time a 64 MiB all-reduce (4 MiB on the CPU), write the result to ``path``."""
    import torch.distributed as dist

    cuda = not dry
    dev = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full(((1 << 24) if cuda else (1 << 20),), float(rank + 1), device=dev)
    dist.all_reduce(x)
    all_reduce_ok = bool((x == world * (world + 1) / 2).all())
    y = torch.arange(1024.0, device=dev) if rank == 0 else torch.zeros(1024, device=dev)
    dist.broadcast(y, 0)
    broadcast_ok = bool(torch.equal(y, torch.arange(1024.0, device=dev)))
    times = []
    sync = torch.cuda.synchronize if cuda else lambda: None
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        sync()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    backend = dist.get_backend()
    dist.destroy_process_group()
    result = {
        "backend": str(backend),
        "world_size": world,
        "all_reduce_ok": all_reduce_ok,
        "broadcast_ok": broadcast_ok,
        "all_reduce_mib": x.numel() * 4 / 2**20,
        "all_reduce_ms": sorted(times)[len(times) // 2] * 1e3,
        "ok": all_reduce_ok and broadcast_ok,
    }
    if rank == 0:
        path.write_text(json.dumps(result))
    return 0 if result["ok"] else 1


# ------------------------------------------------------------------------------------------ the steps


def _resnet_case(dry: bool) -> tuple[Workload, Setup, int, dict[str, Any]]:
    setup = Setup("cpu" if dry else "cuda", torch.bfloat16, channels_last=True)
    if dry:
        from kfac_bench.models.cifar_resnet import build_cifar_resnet

        batch, size, model, classes = 4, 32, "CIFAR ResNet-8", 10
        build: Callable[[], nn.Module] = functools.partial(build_cifar_resnet, 8)
        label = (
            "ResNet-50 [dry run: CIFAR ResNet-8, 32², batch 4, bf16 autocast, channels_last, CPU]"
        )
    else:
        from kfac_bench.models.torchvision_models import build_torchvision_resnet

        batch, size, model, classes = 64, 224, "torchvision resnet50", 1000
        build = functools.partial(build_torchvision_resnet, "resnet50")
        label = "ResNet-50, 224², batch 64, bf16 autocast, channels_last"
    w = classification("resnet50", build, (batch, 3, size, size), classes)
    meta = {"label": label, "model": model, "batch": batch, "image_size": size, "precision": "bf16"}
    return w, setup, size, meta | {"channels_last": True, "device": setup.device}


def _side_by_side_step(
    ctx: StepContext, w: Workload, setup: Setup, meta: dict[str, Any], share: float
) -> None:
    ctx.record("workload", meta)
    deadline = time.monotonic() + share * ctx.time_left()
    with cudnn_autotune(setup):
        side_by_side(w, setup, list(CADENCES), 1 if ctx.dry else 4, deadline, ctx.record)


def resnet50(ctx: StepContext) -> None:
    """ResNet-50 224², batch 64, bf16, channels_last: side by side, then the conv-factor dispatch."""
    w, setup, size, meta = _resnet_case(ctx.dry)
    _side_by_side_step(ctx, w, setup, meta, share=0.75)
    _release(setup)
    shapes = conv_shapes(w.build(), size, meta["batch"])
    conv_dispatch(shapes, setup, 1 if ctx.dry else 3, ctx.deadline, ctx.record)


def bert_large(ctx: StepContext) -> None:
    """BERT-Large at seq 512, batch 8, fp16 with GradScaler: side by side."""
    setup = Setup("cpu" if ctx.dry else "cuda", torch.float16, grad_scaler=True)
    preset, seq, batch, vocab = ("tiny", 32, 2, 1000) if ctx.dry else ("large", 512, 8, None)
    w = bert_workload(preset, seq, batch, name="bert_large", vocab_size=vocab)
    label = (
        "BERT-Large [dry run: tiny preset (2 layers, hidden 128, vocabulary 1000), seq 32, batch 2, "
        "fp16 + GradScaler, CPU]"
        if ctx.dry
        else "BERT-Large (24 layers, hidden 1024), seq 512, batch 8, fp16 autocast + GradScaler"
    )
    meta = {"label": label, "preset": preset, "seq": seq, "batch": batch, "precision": "fp16"}
    _side_by_side_step(
        ctx, w, setup, meta | {"grad_scaler": True, "device": setup.device}, share=1.0
    )


def memory(ctx: StepContext) -> None:
    """The ResNet-50 case's ``memory_usage()`` against the allocator's deltas."""
    w, setup, _size, meta = _resnet_case(ctx.dry)
    ctx.record("workload", meta)
    memory_figures(w, setup, 2, ctx.record)


def ops(ctx: StepContext) -> None:
    """CIFAR ResNet-32 (batch 128, fp32, factors every step, decompositions every 10): compute ops, CUDA
    kernel launches and their device time per step, SGD vs K-FAC by stage (:mod:`benchmarks.ops`)."""
    from benchmarks import ops as op_count
    from kfac_bench.models.cifar_resnet import build_cifar_resnet

    depth, batch, steps = (8, 4, 2) if ctx.dry else (32, 128, 10)
    w = classification(f"resnet{depth}", lambda: build_cifar_resnet(depth), (batch, 3, 32, 32), 10)
    setup = Setup("cpu" if ctx.dry else "cuda")
    ctx.record("workload", {"label": f"CIFAR ResNet-{depth}, batch {batch}, fp32", "steps": steps})
    r = op_count.measure(
        w, factor_steps=1, inv_steps=10, steps=steps, warmup=1 if ctx.dry else 3, setup=setup
    )
    ctx.record("ops", {"table": op_count.table(r), **r})
