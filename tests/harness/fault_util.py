"""Helpers of the fault-injection tests: start the real CLI, wait for its records, read what it left."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.harness.util import REPO, cli_command, cli_env
from tests.limits import hang_limit

#: The tests' model builder that injects one fault (tests/harness/faulty.py), importable by every rank.
FAULTY = "model._target_=tests.harness.faulty.build_fault_once"


def env(**extra: str) -> dict[str, str]:
    """The CLI's environment with this repository importable (for the faulty model) and ``extra``."""
    e = cli_env()
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


#: What start() and run() use without an ``env`` argument (whose name shadows :func:`env` there).
_default_env = env


def fault(
    marker: Path, at: int, action: str, rank: int = 0, store: Path | None = None
) -> list[str]:
    """Overrides that make the model do ``action`` once, at its ``at``-th training step on ``rank``
    (``store``: the folder a ``store-*`` action breaks; tests/harness/faulty.py)."""
    return [
        FAULTY,
        f"+model.marker={marker}",
        f"+model.at={at}",
        f"+model.action={action}",
        f"+model.rank={rank}",
        *([f"+model.store={store}"] if store is not None else []),
    ]


def start(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    start_new_session: bool = False,
) -> subprocess.Popen[str]:
    """``python -m kfac_bench.cli ARGS`` in the background, in a session of its own if asked: a real process,
    as the tests that signal, kill or race it need."""
    return subprocess.Popen(
        cli_command(*args),
        cwd=cwd,
        env=_default_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=start_new_session,
    )


def run(
    *args: str,
    cwd: Path,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    rlimits: Mapping[int, tuple[int, int]] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m kfac_bench.cli ARGS`` to its end; ``rlimits``: :func:`resource.setrlimit` limits of the
    run."""

    def limit() -> None:
        for which, limits in (rlimits or {}).items():
            resource.setrlimit(which, limits)

    return subprocess.run(
        cli_command(*args),
        cwd=cwd,
        env=_default_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=hang_limit(timeout),
        preexec_fn=limit if rlimits else None,
    )


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def eval_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in records(run_dir)]


def wait_for_records(
    run_dir: Path, n: int, proc: subprocess.Popen[str], timeout: float = 90
) -> None:
    """Until ``eval.jsonl`` holds ``n`` records (fails if ``proc`` ends first)."""
    deadline = time.monotonic() + hang_limit(timeout)
    while len(records(run_dir)) < n:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"ended early ({proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {n} records in {run_dir} after {hang_limit(timeout):.0f} s")
        time.sleep(0.05)


def one_error_line(stderr: str) -> str:
    """The single line of ``stderr``, which must be a kfac-bench error."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfac-bench: error: "), stderr[-3000:]
    return lines[0]


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (e.g. a run directory: orphaned ranks)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under ``run_dir`` (relative path -> bytes), but the lock file's holder text."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def shim(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def slurm_env(
    tmp_path: Path, srun: str | None = None, scontrol: str | None = None
) -> dict[str, str]:
    """SLURM variables of a one-node job, with ``srun``/``scontrol`` replaced by shims on PATH: by default
    srun drops its options and runs the command, scontrol expands the node list and logs requeues to
    ``scontrol.log``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim(bin_dir / "srun", srun or 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    shim(
        bin_dir / "scontrol",
        scontrol
        or 'if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; else echo "$*" >> "$SCONTROL_LOG"; fi\n',
    )
    e = env()
    for gpus in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "CUDA_VISIBLE_DEVICES"):
        e.pop(gpus, None)  # the GPU count is the test's to give
    e.update(
        PATH=f"{bin_dir}{os.pathsep}{e['PATH']}",
        PYTHON=sys.executable,
        SLURM_JOB_ID="4242",
        SLURM_NNODES="1",
        SLURM_NTASKS="1",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_SUBMIT_DIR=str(tmp_path),
        GPUS_PER_NODE="2",
        RDZV_PORT=str(20000 + os.getpid() % 20000),
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
    )
    return e


def sbatch(tmp_path: Path, e: dict[str, str], *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """``bash launch/slurm.sbatch ARGS`` (what the batch step runs) in the background."""
    return subprocess.Popen(
        ["bash", str(REPO / "launch" / "slurm.sbatch"), *args],
        cwd=kwargs.pop("cwd", tmp_path),
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )
