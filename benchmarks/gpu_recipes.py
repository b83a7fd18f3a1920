"""The GPU check's ``recipes`` step: the smoke recipes through the ``kfac-bench`` CLI as a user runs them,
one under ``launcher=torchrun``, and a world-1 collectives probe (NCCL on CUDA, gloo on the CPU).

At world 1 the harness starts no process group (``kfac_bench/launcher/distributed.py``: ``distributed`` is
``world_size > 1``), so the torchrun run exercises the launcher but not NCCL; the probe joins an NCCL group of
one rank through torchrun and checks an all-reduce and a broadcast on the device.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_steps import REPO, Context, Finished, run_group

#: (name, overrides, share of the step's time). Precision is used on CUDA only (fp32 on the CPU).
RECIPE_RUNS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("maskrcnn", ("+recipe=maskrcnn_coco_smoke",), 4.0),
    ("bert", ("+recipe=bert_large_pretrain_phase1_smoke", "train.precision=fp16"), 2.0),
    (
        "bert_torchrun",
        (
            "+recipe=bert_large_pretrain_phase1_smoke",
            "train.precision=fp16",
            "launcher=torchrun",
            "launcher.nproc_per_node=1",
        ),
        2.0,
    ),
)
PROBE_SHARE = 1.0
SUMMARY_FIELDS = (
    "status",
    "steps",
    "mean_step_time_s",
    "samples_per_s",
    "kfac_enabled",
    "kfac_stage_times_s",
    "kfac_memory_bytes",
    "peak_memory_bytes",
    "world_size",
    "device",
    "final_metrics",
)


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("kfac-bench")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kfac_bench.cli"]


def recipes(ctx: Context) -> None:
    """The smoke recipes as a user runs them, cut to 2 steps and one evaluation batch, then a world-1
    NCCL (gloo on the CPU) collectives probe under torchrun."""
    device = "cpu" if ctx.dry else "cuda"
    runs: dict[str, dict[str, Any]] = {}
    shares = [s for *_, s in RECIPE_RUNS] + [PROBE_SHARE]
    for i, (name, overrides, share) in enumerate(RECIPE_RUNS):
        run_dir = ctx.work / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a previous run's checkpoint would be resumed
        cmd = [*_cli(), "train", *overrides, f"train.device={device}", "train.max_steps=2"]
        cmd += ["train.limit_eval_batches=1", "train.tensorboard=false", "train.progress=lines"]
        cmd += [f"hydra.run.dir={run_dir}"]
        timeout = ctx.time_left() * share / sum(shares[i:])
        done = run_group(cmd, timeout, ctx.out, ctx.work / f"{name}.log")
        runs[name] = _run_result(done, cmd, run_dir, ctx.dry)
        ctx.record("runs", runs)
    probe = ctx.work / "collectives.json"
    probe.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += ["-m", "benchmarks.gpu_check", "--collective-probe", str(probe)]
    done = run_group(
        cmd + (["--dry-run"] if ctx.dry else []), ctx.time_left(), REPO, ctx.work / "probe.log"
    )
    result = json.loads(probe.read_text()) if probe.is_file() else {"ok": False}
    result |= {"exit_status": done.exit_status, "wall_s": done.wall_s}
    if done.exit_status != 0:
        result["ok"], result["output_tail"] = False, done.output[-2000:]
    ctx.record("collectives", result)


def _run_result(done: Finished, cmd: list[str], run_dir: Path, dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "command": " ".join(cmd),
        "exit_status": done.exit_status,
        "wall_s": done.wall_s,
    }
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        out |= {k: s.get(k) for k in SUMMARY_FIELDS}
    on_device = dry or (out.get("device") not in (None, "cpu"))
    out["ok"] = (
        done.exit_status == 0
        and out.get("status") in ("success", "target_not_reached")
        and on_device
    )
    if not out["ok"]:
        out["output_tail"] = done.output[-2000:]
    return out


def collective_probe(path: Path, dry: bool) -> int:
    """One torchrun rank: join the process group (NCCL on CUDA, gloo on the CPU), all-reduce and broadcast,
    check the values, time a 64 MiB all-reduce (4 MiB on the CPU), write the result to ``path``."""
    import torch
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
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
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
