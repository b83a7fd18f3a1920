"""The GPU check's steps. Each runs in its own process (``benchmarks/gpu_check.py``) and reports figures
through ``ctx.record(key, value)`` as soon as it has them; ``ctx.dry`` selects tiny CPU sizes.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]


class Context(Protocol):
    dry: bool
    out: Path  # the report directory; CLI runs start here (their data/ goes here)
    work: Path  # runs, logs, partial results
    deadline: float  # time.monotonic() by which the step should have finished

    def record(self, key: str, value: Any) -> None: ...

    def time_left(self) -> float: ...


# ------------------------------------------------------------------------------------------ subprocess


def child_env() -> dict[str, str]:
    """This environment for a child process: the repository importable, no outer torchrun/SLURM job."""
    from kfac_bench.launcher.torchrun import outside_job_env

    env = outside_job_env()
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@dataclass
class Finished:
    exit_status: int | None  # None: killed at the timeout
    wall_s: float
    output: str


def run_group(cmd: list[str], timeout: float, cwd: Path, log: Path) -> Finished:
    """Run ``cmd`` in its own process group; at ``timeout`` the whole group (e.g. torchrun and its
    workers) gets SIGTERM, then SIGKILL. Output goes to ``log`` and is returned."""
    import signal

    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=child_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            rc = None
            kill_group(proc, signal.SIGTERM)
        except BaseException:
            kill_group(proc, signal.SIGTERM)
            raise
    return Finished(rc, time.monotonic() - t0, log.read_text(errors="replace"))


def kill_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Signal ``proc``'s process group; SIGKILL it if it is still there 10 s later (torchrun needs a few
    seconds to stop its workers, which run in sessions of their own)."""
    import signal

    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(proc.pid, s)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------------------- environment


def environment(ctx: Context) -> None:
    import importlib.metadata as md

    d: dict[str, Any] = {
        "dry_run": ctx.dry,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    # The host's facts first: a CUDA runtime that hangs while torch loads it still leaves them.
    ctx.record("environment", dict(d))

    import torch

    d |= {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    try:
        d["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError, TypeError):
        d["nccl"] = None
    for pkg in ("torchvision", "transformers", "hydra-core"):
        try:
            d[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            d[pkg] = None
    from kfac_bench.metrics.summary import git_commit

    d["git_commit"] = git_commit(REPO)
    if torch.cuda.is_available() and not ctx.dry:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        d |= {
            "device_name": props.name,
            "device_count": torch.cuda.device_count(),
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "device_memory_bytes": total,
            "device_memory_free_bytes": free,
            "driver": _nvidia_smi("driver_version"),
        }
    else:
        d |= {
            "device_name": f"CPU {platform.machine()} (dry run)",
            "device_memory_bytes": None,
            "driver": None,
        }
    ctx.record("environment", d)
    ctx.record("device_name", d["device_name"])


def _nvidia_smi(field: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (
        out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    )


# ------------------------------------------------------------------------------------------- gpu tests


def gpu_tests(ctx: Context) -> None:
    """``pytest -m gpu`` on the test files that use the marker (collecting the whole suite costs time)."""
    files = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text(errors="replace")
    )
    ctx.record("files", files)
    xml = ctx.work / "gpu-tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    done = run_group(
        [*cmd, f"--junitxml={xml}", *files], ctx.time_left(), REPO, ctx.work / "pytest.log"
    )
    ctx.record("exit_status", done.exit_status)
    ctx.record("wall_s", done.wall_s)
    ctx.record("output_tail", done.output[-3000:])
    if done.exit_status is None or not xml.is_file():
        raise RuntimeError(
            f"pytest -m gpu did not finish (exit {done.exit_status}); see output_tail"
        )
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, skipped = [], set()
    for suite in ET.parse(xml).getroot().iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
        for case in suite.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    failed.append(f"{name}: {(el.get('message') or '').splitlines()[0][:200]}")
            sk = case.find("skipped")
            if sk is not None:
                skipped.add(sk.get("message") or "")
    for k, v in counts.items():
        ctx.record(k, v)
    ctx.record(
        "passed", counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    )
    ctx.record("failed_tests", failed)
    ctx.record("skip_reasons", sorted(skipped))


# ------------------------------------------------------------------------------------- side by side


def _resnet_case(dry: bool) -> tuple[Any, Any, int, dict[str, Any]]:
    import torch

    from benchmarks.overhead import Setup, _classification

    setup = Setup("cpu" if dry else "cuda", torch.bfloat16, channels_last=True)
    if dry:
        from kfac_bench.models.cifar_resnet import build_cifar_resnet

        batch, size, model = 4, 32, "CIFAR ResNet-8"
        w = _classification("resnet50", lambda: build_cifar_resnet(8), (batch, 3, size, size), 10)
        label = (
            "ResNet-50 [dry run: CIFAR ResNet-8, 32², batch 4, bf16 autocast, channels_last, CPU]"
        )
    else:
        from kfac_bench.models.torchvision_models import build_torchvision_resnet

        batch, size, model = 64, 224, "torchvision resnet50"
        w = _classification(
            "resnet50", lambda: build_torchvision_resnet("resnet50"), (batch, 3, size, size), 1000
        )
        label = "ResNet-50, 224², batch 64, bf16 autocast, channels_last"
    meta = {"label": label, "model": model, "batch": batch, "image_size": size, "precision": "bf16"}
    return w, setup, size, meta | {"channels_last": True, "device": setup.device}


def _bert_case(dry: bool) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    from benchmarks.overhead import Setup, bert_workload

    setup = Setup("cpu" if dry else "cuda", torch.float16, grad_scaler=True)
    preset, seq, batch, vocab = ("tiny", 32, 2, 1000) if dry else ("large", 512, 8, None)
    w = bert_workload(preset, seq, batch, name="bert_large", vocab_size=vocab)
    label = (
        "BERT-Large [dry run: tiny preset (2 layers, hidden 128, vocabulary 1000), seq 32, batch 2, "
        "fp16 + GradScaler, CPU]"
        if dry
        else "BERT-Large (24 layers, hidden 1024), seq 512, batch 8, fp16 autocast + GradScaler"
    )
    meta = {"label": label, "preset": preset, "seq": seq, "batch": batch, "precision": "fp16"}
    return w, setup, meta | {"grad_scaler": True, "device": setup.device}


def _measure(ctx: Context, w: Any, setup: Any, meta: dict[str, Any], share: float) -> None:
    from benchmarks.gpu_measure import cudnn_autotune, side_by_side
    from benchmarks.gpu_report import CADENCES

    ctx.record("workload", meta)
    deadline = time.monotonic() + share * ctx.time_left()
    with cudnn_autotune(setup):
        side_by_side(w, setup, list(CADENCES), 1 if ctx.dry else 4, deadline, ctx.record)


def resnet50(ctx: Context) -> None:
    from benchmarks.gpu_measure import conv_dispatch, conv_shapes

    w, setup, size, meta = _resnet_case(ctx.dry)
    _measure(ctx, w, setup, meta, share=0.75)
    _free(setup)
    shapes = conv_shapes(w.build(), size, meta["batch"])
    conv_dispatch(shapes, setup, 1 if ctx.dry else 3, ctx.deadline, ctx.record)


def bert_large(ctx: Context) -> None:
    w, setup, meta = _bert_case(ctx.dry)
    _measure(ctx, w, setup, meta, share=1.0)


def memory(ctx: Context) -> None:
    from benchmarks.gpu_measure import memory as measure_memory

    w, setup, _size, meta = _resnet_case(ctx.dry)
    ctx.record("workload", meta)
    measure_memory(w, setup, 2, ctx.record)


def _free(setup: Any) -> None:
    import gc

    import torch

    gc.collect()
    if setup.device_type == "cuda":
        torch.cuda.empty_cache()
