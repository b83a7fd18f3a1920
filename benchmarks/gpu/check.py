"""GPU check: one short, self-reporting run of the CUDA / NCCL / AMP paths on one device.

Run ``python -m benchmarks.gpu`` (or ``make gpu-check``) on a machine with a CUDA device; it takes about 5
minutes and at most ``--time-limit`` (450 s) and writes ``gpu-report.json`` and ``gpu-report.md`` to ``--out``
(default: the current directory), and ``gpu-profile.yaml``, the ResNet-50 stage costs as a profile for
``kfac-bench plan`` (``benchmarks/gpu/profile.py``). ``--dry-run`` runs every step at tiny sizes on the CPU
and writes the same files (the test suite runs it).

Steps (each a section of the report, in this order): ``environment`` (device, driver, CUDA / cuDNN / NCCL /
torch versions), ``gpu_tests`` (``pytest -m gpu``), ``resnet50`` (ResNet-50 224², batch 64, bf16,
channels_last: SGD vs SGD + K-FAC side by side at 10/100 and 50/500, TPDS Fig. 7's stages, the
decomposition stage vs bare eigh, the conv-factor dispatch), ``memory`` (the engine's ``memory_usage()``
against the CUDA allocator's deltas), ``bert_large`` (BERT-Large at seq 512, fp16 with GradScaler: the same
measurement), ``ops`` (CIFAR ResNet-32, batch 128: compute ops, CUDA kernels and their device time per step,
SGD vs K-FAC by stage, ``benchmarks/ops.py``) and ``recipes`` (Mask R-CNN and BERT smoke recipes through the
CLI on CUDA, one under ``launcher=torchrun``, and an NCCL collectives probe at world 1). The measuring steps
live in ``measure.py``, the report's layout, targets and markdown in ``report.py``.

Every step runs in its own process group with its own time budget (a dry run has none unless
``--time-limit`` is given: CPU speed says nothing about a GPU's): a step that raises, crashes the CUDA
context or hangs is recorded (``failed`` / ``timeout``) and the next step still runs. Steps report figures as
they measure them and the report files are rewritten each time, so a run killed from outside still leaves
the figures it had. Exit status: 0 when every step finished, 1 when one failed or ran out of time, 2 for a
usage error (no CUDA device without ``--dry-run``). The orchestrator and the steps that need no torch
(``gpu_tests``, an injected failure) do not import it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu import profile as gpu_profile
from benchmarks.gpu import report as gpu_report

REPO = Path(__file__).resolve().parents[2]
#: Seconds for the whole check on a GPU: a margin within 8 minutes of device time. A dry run has no limit
#: unless --time-limit is given: it rehearses the steps on a CPU whose speed says nothing about a GPU's;
#: whoever runs it (the test suite) bounds it as a hang.
TIME_LIMIT_S = 450.0
#: Steps aim to finish within this share of their budget; the whole budget is the hard limit.
COOPERATIVE_SHARE = 0.8


def work_dir(out: Path) -> Path:
    """Runs, logs and partial results: ``OUT/runs/gpu-check`` (``runs/`` is git-ignored)."""
    return out / "runs" / "gpu-check"


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class StepContext:
    """What a step sees in its own process: sizes (``dry``: tiny, on the CPU), the report directory ``out``
    (CLI runs start there), ``work`` (runs, logs, partial results), ``deadline`` (``time.monotonic()`` by
    which it should have finished), and ``record`` for figures, written to its part file at once."""

    def __init__(self, name: str, dry: bool, out: Path, budget_s: float | None) -> None:
        self.dry, self.out, self.work = dry, out, work_dir(out)
        budget = math.inf if budget_s is None else budget_s
        self.deadline = time.monotonic() + COOPERATIVE_SHARE * budget
        self.part = self.work / "parts" / f"{name}.json"
        self.part.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {}
        self.write("running")

    def record(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.write("running")

    def time_left(self) -> float:
        return max(self.deadline - time.monotonic(), 1.0)

    def write(self, status: str, error: str | None = None) -> None:
        _atomic(
            self.part,
            json.dumps({"status": status, "error": error, "data": self.data}, default=str),
        )


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


def run_group(
    cmd: list[str],
    timeout: float | None,
    cwd: Path,
    log: Path,
    poll: Callable[[], None] | None = None,
) -> Finished:
    """Run ``cmd`` in its own process group, its output to ``log`` (and returned), calling ``poll`` every
    half second while it runs. At ``timeout`` (None: none), or when this process is interrupted, the whole
    group (e.g. torchrun and its workers) gets SIGTERM, then SIGKILL."""
    t0 = time.monotonic()
    deadline = math.inf if timeout is None else t0 + max(timeout, 1.0)
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=child_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        rc: int | None = None
        try:
            while rc is None and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rc = proc.wait(timeout=max(min(0.5, deadline - time.monotonic()), 0.01))
                if poll is not None:
                    poll()
            if rc is None:
                kill_group(proc, signal.SIGTERM)
        except BaseException:
            kill_group(proc, signal.SIGTERM)
            raise
    return Finished(rc, time.monotonic() - t0, log.read_text(errors="replace"))


def kill_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Signal ``proc``'s process group; SIGKILL it if it is still there 10 s later (torchrun needs a few
    seconds to stop its workers, which run in sessions of their own)."""
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


# ----------------------------------------------------------------------------- steps that run commands


def environment(ctx: StepContext) -> None:
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
    from kfac_bench.metrics.environment import git_commit

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
        name = f"CPU {platform.machine()} (dry run)"
        d |= {"device_name": name, "device_memory_bytes": None, "driver": None}
    ctx.record("environment", d)
    ctx.record("device_name", d["device_name"])


def _nvidia_smi(field: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, f"--query-gpu={field}", "--format=csv,noheader"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return (
        out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    )


def gpu_tests(ctx: StepContext) -> None:
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
    cmd += [f"--junitxml={xml}", *files]
    done = run_group(cmd, ctx.time_left(), REPO, ctx.work / "pytest.log")
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


#: The recipes step's CLI runs: (name, overrides, share of the step's time). Precision is used on CUDA only
#: (fp32 on the CPU). At world 1 the harness starts no process group, so the torchrun run exercises the
#: launcher but not NCCL; the collectives probe (share 1) joins an NCCL group of one rank through torchrun.
_BERT = ("+recipe=bert_large_pretrain_phase1_smoke", "train.precision=fp16")
RECIPE_RUNS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("maskrcnn", ("+recipe=maskrcnn_coco_smoke",), 4.0),
    ("bert", _BERT, 2.0),
    ("bert_torchrun", (*_BERT, "launcher=torchrun", "launcher.nproc_per_node=1"), 2.0),
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


def recipes(ctx: StepContext) -> None:
    """The smoke recipes as a user runs them, cut to 2 steps and one evaluation batch, then a world-1
    NCCL (gloo on the CPU) collectives probe under torchrun."""
    script = Path(sys.executable).with_name("kfac-bench")
    cli = [str(script)] if script.is_file() else [sys.executable, "-m", "kfac_bench.cli"]
    runs: dict[str, dict[str, Any]] = {}
    shares = [s for *_, s in RECIPE_RUNS] + [PROBE_SHARE]
    for i, (name, overrides, share) in enumerate(RECIPE_RUNS):
        run_dir = ctx.work / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a previous run's checkpoint would be resumed
        cmd = [*cli, "train", *overrides, f"train.device={'cpu' if ctx.dry else 'cuda'}"]
        cmd += ["train.max_steps=2", "train.limit_eval_batches=1", "train.tensorboard=false"]
        cmd += ["train.progress=lines", f"hydra.run.dir={run_dir}"]
        timeout = ctx.time_left() * share / sum(shares[i:])
        done = run_group(cmd, timeout, ctx.out, ctx.work / f"{name}.log")
        runs[name] = _run_result(done, cmd, run_dir, ctx.dry)
        ctx.record("runs", runs)
    probe = ctx.work / "collectives.json"
    probe.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += ["-m", "benchmarks.gpu", "--collective-probe", str(probe)] + (
        ["--dry-run"] if ctx.dry else []
    )
    done = run_group(cmd, ctx.time_left(), REPO, ctx.work / "probe.log")
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
    finished = out.get("status") in ("success", "target_not_reached")
    out["ok"] = done.exit_status == 0 and finished and on_device
    if not out["ok"]:
        out["output_tail"] = done.output[-2000:]
    return out


# ------------------------------------------------------------------------------------------ the check


def _measured(name: str) -> Callable[[StepContext], None]:
    """The step ``measure.<name>``, imported when it runs (``measure`` imports torch)."""

    def step(ctx: StepContext) -> None:
        from benchmarks.gpu import measure

        getattr(measure, name)(ctx)

    return step


#: Step name -> (title, function, budget on a GPU in s, least useful time in s), in running order: the
#: cheap and the target-bearing steps first, so a run cut short loses the long tail. Budgets sum to 480 s.
STEPS: dict[str, tuple[str, Callable[[StepContext], None], float, float]] = {
    "environment": ("environment: device, driver, versions", environment, 15, 5),
    "gpu_tests": ("pytest -m gpu", gpu_tests, 75, 20),
    "resnet50": (
        "ResNet-50: SGD vs SGD + K-FAC, stages, eigh, conv dispatch",
        _measured("resnet50"),
        100,
        30,
    ),
    "memory": ("memory: memory_usage() vs allocator deltas", _measured("memory"), 40, 15),
    "bert_large": (
        "BERT-Large: SGD vs SGD + K-FAC, stages, eigh",
        _measured("bert_large"),
        100,
        30,
    ),
    "ops": ("compute ops and CUDA kernel launches per step by stage", _measured("ops"), 30, 15),
    "recipes": ("smoke recipes through the CLI, torchrun + NCCL", recipes, 120, 30),
}


def write_report(report: dict, out: Path) -> None:
    """Evaluate the targets and (re)write ``gpu-report.json`` and ``gpu-report.md`` atomically."""
    report["updated"] = gpu_report.now()
    report["targets"] = gpu_report.targets(report)
    _atomic(out / gpu_report.JSON_NAME, json.dumps(report, indent=2, default=str) + "\n")
    _atomic(out / gpu_report.MD_NAME, gpu_report.markdown(report))
    profile = gpu_profile.profile_text(report)  # for kfac-bench plan plan.profile_file=...
    if profile is not None:
        _atomic(out / gpu_profile.NAME, profile)


def run_child(args: argparse.Namespace) -> int:
    """The step ``args.step`` in this process: its figures and final status go to its part file."""
    name = args.step
    # SIGTERM (the step's budget is over) unwinds the stack, so a running subprocess group is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    ctx = StepContext(name, args.dry_run, args.out, args.budget_s)
    if args.hang_step == name:
        record = ctx.record

        def record_then_hang(key: str, value: Any) -> None:
            record(key, value)
            time.sleep(1e6)

        ctx.record = record_then_hang  # type: ignore[method-assign]
    try:
        if args.dry_run:
            # One compute thread (the development machine is small and shared), set for torch before a step
            # imports it.
            os.environ["OMP_NUM_THREADS"] = "1"
        if args.fail_step == name:
            raise RuntimeError(f"failure injected by --fail-step {name}")
        STEPS[name][1](ctx)
    except Exception:
        ctx.write("failed", traceback.format_exc(limit=-10)[-4000:])
        return 1
    ctx.write("ok")
    return 0


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the check (e.g. the machine's time ran out)."""


def _interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def run_steps(args: argparse.Namespace, names: list[str]) -> int:
    """Each step in its own process group within its budget; the report is rewritten as figures arrive."""
    out: Path = args.out
    (work_dir(out) / "parts").mkdir(parents=True, exist_ok=True)
    limit = args.time_limit or (None if args.dry_run else TIME_LIMIT_S)
    titles = {n: t for n, (t, *_rest) in STEPS.items()}
    report = gpu_report.new_report(titles, args.dry_run, " ".join(sys.argv), limit)
    for n in STEPS:
        if n not in names:
            report["sections"][n] |= {
                "status": "skipped",
                "error": "not selected (--only / --skip)",
            }
    write_report(report, out)
    start = time.monotonic()
    old = [signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)]
    try:
        for i, name in enumerate(names):
            _, _, budget, least = STEPS[name]
            later = sum(STEPS[n][3] for n in names[i + 1 :])
            left = None if limit is None else limit - (time.monotonic() - start) - later
            allowed = None if left is None else min(budget, left)
            sec = report["sections"][name]
            if allowed is not None and allowed < least:
                sec |= {"status": "skipped", "error": f"out of time ({allowed:.0f} s left for it)"}
                write_report(report, out)
                continue
            _run_one(name, allowed, args, report)
            print(
                f"gpu-check: {name}: {sec['status']} in {sec['duration_s']:.1f} s", file=sys.stderr
            )
        report["status"] = "complete"
    except Interrupted as exc:
        report["status"] = f"interrupted ({exc})"
    finally:
        for s, handler in zip((signal.SIGTERM, signal.SIGINT), old):
            signal.signal(s, handler)
        report["finished"] = gpu_report.now()
        write_report(report, out)
    json_path, md_path = out / gpu_report.JSON_NAME, out / gpu_report.MD_NAME
    print(f"gpu-check: wrote {json_path} and {md_path}", file=sys.stderr)
    for t in report["targets"]:
        print(f"gpu-check: target {t['name']}: {t['status']}", file=sys.stderr)
    ok = report["status"] == "complete"
    return 0 if ok and all(report["sections"][n]["status"] == "ok" for n in names) else 1


def _run_one(name: str, budget: float | None, args: argparse.Namespace, report: dict) -> None:
    """Run step ``name`` in its own process group; kill it after ``budget`` seconds (None: no budget)."""
    sec = report["sections"][name]
    part = work_dir(args.out) / "parts" / f"{name}.json"
    part.unlink(missing_ok=True)
    sec |= {"status": "running", "budget_s": budget}
    write_report(report, args.out)
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--step", name, "--out", str(args.out)]
    cmd += [] if budget is None else ["--budget-s", f"{budget:.1f}"]
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += ["--fail-step", args.fail_step] if args.fail_step else []
    cmd += ["--hang-step", args.hang_step] if args.hang_step else []
    t0, seen = time.monotonic(), 0.0

    def refresh() -> None:  # the step's figures into the report as they arrive
        nonlocal seen
        if part.is_file() and part.stat().st_mtime != seen:
            seen = part.stat().st_mtime
            _merge(sec, part)
            sec["duration_s"] = time.monotonic() - t0
            write_report(report, args.out)

    try:
        done = run_group(cmd, budget, REPO, work_dir(args.out) / f"{name}.log", poll=refresh)
    except BaseException:
        _merge(sec, part)
        sec |= {"status": "interrupted", "duration_s": time.monotonic() - t0}
        raise
    _merge(sec, part)
    sec["duration_s"] = time.monotonic() - t0
    if done.exit_status is None:
        sec |= {"status": "timeout", "error": f"killed after its budget of {budget:.0f} s"}
    elif sec["status"] not in ("ok", "failed"):  # died without a word (e.g. a crash in native code)
        tail = done.output[-2000:]
        sec |= {
            "status": "failed",
            "error": f"exit status {done.exit_status}; output tail:\n{tail}",
        }
    write_report(report, args.out)


def _merge(sec: dict, part: Path) -> None:
    try:
        state = json.loads(part.read_text())
    except (OSError, ValueError):  # not written yet
        return
    sec["data"] = state["data"]
    sec["status"], sec["error"] = state["status"], state["error"]


def parser() -> argparse.ArgumentParser:
    """The check's command line (``python -m benchmarks.gpu``, ``make gpu-check ARGS=...``)."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny sizes on the CPU")
    ap.add_argument("--out", type=Path, default=Path("."), help="report directory (default: .)")
    ap.add_argument("--only", nargs="+", choices=list(STEPS), help="run only these steps")
    ap.add_argument(
        "--skip", nargs="+", choices=list(STEPS), default=[], help="leave these steps out"
    )
    limit = f"seconds for the whole check (default {TIME_LIMIT_S:.0f}; none in a dry run)"
    ap.add_argument("--time-limit", type=float, help=limit)
    fail = "make this step raise at its start (tests the report's failure path)"
    ap.add_argument("--fail-step", choices=list(STEPS), help=fail)
    hang = "make this step hang after its first figure (tests the time budget and partial results)"
    ap.add_argument("--hang-step", choices=list(STEPS), help=hang)
    ap.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)  # a step's own process
    ap.add_argument("--budget-s", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--collective-probe", type=Path, help=argparse.SUPPRESS)  # a torchrun rank
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.out = args.out.resolve()
    if args.collective_probe is not None:
        from benchmarks.gpu.measure import collective_probe

        return collective_probe(args.collective_probe, args.dry_run)
    if args.step is not None:
        return run_child(args)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print(
                "gpu-check: error: no CUDA device is visible; run with --dry-run for the CPU rehearsal",
                file=sys.stderr,
            )
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in STEPS if (args.only is None or n in args.only) and n not in args.skip]
    return run_steps(args, names)
