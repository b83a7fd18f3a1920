"""GPU check: one short, self-reporting run of the CUDA / NCCL / AMP paths on one device.

Run ``python -m benchmarks.gpu_check`` (or ``make gpu-check``) on a machine with a CUDA device; it takes
about 5 minutes and at most ``--time-limit`` (450 s) and writes ``gpu-report.json`` and ``gpu-report.md`` to
``--out`` (default: the current directory). ``--dry-run`` runs every step at tiny sizes on the CPU and
writes the same files (the test suite runs it).

Steps (each a section of the report, in this order): ``environment`` (device, driver, CUDA / cuDNN / NCCL /
torch versions), ``gpu_tests`` (``pytest -m gpu``), ``resnet50`` (ResNet-50 224², batch 64, bf16,
channels_last: SGD vs SGD + K-FAC side by side at 10/100 and 50/500, TPDS Fig. 7's stages, the
decomposition stage vs bare eigh, the conv-factor dispatch), ``memory`` (the engine's ``memory_usage()``
against the CUDA allocator's deltas), ``bert_large`` (BERT-Large at seq 512, fp16 with GradScaler: the same
measurement) and ``recipes`` (Mask R-CNN and BERT smoke recipes through the CLI on CUDA, one under
``launcher=torchrun``, and an NCCL collectives probe at world 1).

Every step runs in its own process group with its own time budget (a dry run has none unless
``--time-limit`` is given: CPU speed says nothing about a GPU's): a step that raises, crashes the CUDA
context or hangs is recorded (``failed`` / ``timeout``) and the next step still runs. Steps report figures as
they measure them and the report files are rewritten each time, so a run killed from outside still leaves
the figures it had. Exit status: 0 when every step finished, 1 when one failed or ran out of time, 2 for a
usage error (no CUDA device without ``--dry-run``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import gpu_report
from benchmarks.gpu_markdown import markdown
from benchmarks.gpu_recipes import collective_probe, recipes
from benchmarks.gpu_steps import (
    REPO,
    Context,
    bert_large,
    child_env,
    environment,
    gpu_tests,
    kill_group,
    memory,
    resnet50,
)

#: Step name -> (title, function, budget on a GPU in s, least useful time in s), in running order: the
#: cheap and the target-bearing steps first, so a run cut short loses the long tail. Budgets sum to 480 s.
STEPS: dict[str, tuple[str, Callable[[Context], None], float, float]] = {
    "environment": ("environment: device, driver, versions", environment, 15, 5),
    "gpu_tests": ("pytest -m gpu", gpu_tests, 75, 20),
    "resnet50": ("ResNet-50: SGD vs SGD + K-FAC, stages, eigh, conv dispatch", resnet50, 100, 30),
    "memory": ("memory: memory_usage() vs allocator deltas", memory, 40, 15),
    "bert_large": ("BERT-Large: SGD vs SGD + K-FAC, stages, eigh", bert_large, 100, 30),
    "recipes": ("smoke recipes through the CLI, torchrun + NCCL", recipes, 150, 30),
}

#: Seconds for the whole check on a GPU: a margin within 8 minutes of device time.
TIME_LIMIT_S = 450.0
# A dry run has no time limit unless --time-limit is given: it rehearses the steps on a CPU whose speed says
# nothing about a GPU's (a shared 2-core machine runs them 2-10x slower than a calm one); whoever runs it
# (the test suite) bounds it as a hang.
#: Steps aim to finish within this share of their budget; the whole budget is the hard limit.
COOPERATIVE_SHARE = 0.8


class StepContext:
    """What a step sees in its own process: sizes, directories, deadline, and ``record`` for figures."""

    def __init__(self, name: str, dry: bool, out: Path, budget_s: float | None) -> None:
        self.dry, self.out = dry, out
        self.work = work_dir(out)
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
        text = json.dumps({"status": status, "error": error, "data": self.data}, default=str)
        tmp = self.part.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.part)


def write_report(report: dict, out: Path) -> None:
    """Evaluate the targets and (re)write ``gpu-report.json`` and ``gpu-report.md`` atomically."""
    report["updated"] = gpu_report.now()
    report["targets"] = gpu_report.targets(report)
    _atomic(out / gpu_report.JSON_NAME, json.dumps(report, indent=2, default=str) + "\n")
    _atomic(out / gpu_report.MD_NAME, markdown(report))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def work_dir(out: Path) -> Path:
    """Runs, logs and partial results: ``OUT/runs/gpu-check`` (``runs/`` is git-ignored)."""
    return out / "runs" / "gpu-check"


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
            # imports it: a step that does not need torch (gpu_tests, an injected failure) does not load it.
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
            report["sections"][n]["status"] = "skipped"
            report["sections"][n]["error"] = "not selected (--only / --skip)"
    write_report(report, out)
    start = time.monotonic()
    old = [signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)]
    try:
        for i, name in enumerate(names):
            _, _, budget, least = STEPS[name]
            later = sum(STEPS[n][3] for n in names[i + 1 :])
            allowed = (
                None if limit is None else min(budget, limit - (time.monotonic() - start) - later)
            )
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
    print(
        f"gpu-check: wrote {out / gpu_report.JSON_NAME} and {out / gpu_report.MD_NAME}",
        file=sys.stderr,
    )
    for t in report["targets"]:
        print(f"gpu-check: target {t['name']}: {t['status']}", file=sys.stderr)
    ok = report["status"] == "complete" and all(
        report["sections"][n]["status"] == "ok" for n in names
    )
    return 0 if ok else 1


def _run_one(name: str, budget: float | None, args: argparse.Namespace, report: dict) -> None:
    """Run step ``name`` in its own process group; kill it after ``budget`` seconds (None: no budget)."""
    sec = report["sections"][name]
    part = work_dir(args.out) / "parts" / f"{name}.json"
    part.unlink(missing_ok=True)
    sec |= {"status": "running", "budget_s": budget}
    write_report(report, args.out)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check",
        "--step",
        name,
    ]
    cmd += [] if budget is None else ["--budget-s", f"{budget:.1f}"]
    cmd += ["--out", str(args.out)] + (["--dry-run"] if args.dry_run else [])
    cmd += ["--fail-step", args.fail_step] if args.fail_step else []
    cmd += ["--hang-step", args.hang_step] if args.hang_step else []
    log = work_dir(args.out) / f"{name}.log"
    t0 = time.monotonic()
    seen = 0.0
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=child_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            while proc.poll() is None and (budget is None or time.monotonic() - t0 < budget):
                time.sleep(0.5)
                if part.is_file() and part.stat().st_mtime != seen:
                    seen = part.stat().st_mtime
                    _merge(sec, part)
                    sec["duration_s"] = time.monotonic() - t0
                    write_report(report, args.out)
            timed_out = proc.poll() is None
            if timed_out:
                kill_group(proc, signal.SIGTERM)
        except BaseException:
            kill_group(proc, signal.SIGTERM)
            _merge(sec, part)
            sec |= {"status": "interrupted", "duration_s": time.monotonic() - t0}
            raise
    _merge(sec, part)
    sec["duration_s"] = time.monotonic() - t0
    if timed_out:
        sec |= {"status": "timeout", "error": f"killed after its budget of {budget:.0f} s"}
    elif sec["status"] not in ("ok", "failed"):  # died without a word (e.g. a crash in native code)
        tail = log.read_text(errors="replace")[-2000:]
        sec |= {"status": "failed", "error": f"exit status {proc.returncode}; output tail:\n{tail}"}
    write_report(report, args.out)


def _merge(sec: dict, part: Path) -> None:
    try:
        state = json.loads(part.read_text())
    except (OSError, ValueError):  # not written yet
        return
    sec["data"] = state["data"]
    sec["status"], sec["error"] = state["status"], state["error"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny sizes on the CPU")
    ap.add_argument("--out", type=Path, default=Path("."), help="report directory (default: .)")
    ap.add_argument("--only", nargs="+", choices=list(STEPS), help="run only these steps")
    ap.add_argument(
        "--skip", nargs="+", choices=list(STEPS), default=[], help="leave these steps out"
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        help=f"seconds for the whole check (default {TIME_LIMIT_S:.0f}; none in a dry run)",
    )
    ap.add_argument(
        "--fail-step",
        choices=list(STEPS),
        help="make this step raise at its start (tests the report's failure path)",
    )
    ap.add_argument(
        "--hang-step",
        choices=list(STEPS),
        help="make this step hang after its first figure (tests the time budget and partial results)",
    )
    ap.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)  # a step's own process
    ap.add_argument("--budget-s", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--collective-probe", type=Path, help=argparse.SUPPRESS)  # a torchrun rank
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.collective_probe is not None:
        return collective_probe(args.collective_probe, args.dry_run)
    if args.step is not None:
        return run_child(args)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print(
                "gpu_check: error: no CUDA device is visible; run with --dry-run for the CPU rehearsal",
                file=sys.stderr,
            )
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in STEPS if (args.only is None or n in args.only) and n not in args.skip]
    return run_steps(args, names)


if __name__ == "__main__":
    raise SystemExit(main())
