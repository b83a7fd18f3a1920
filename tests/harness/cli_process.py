"""``python -m kfac_bench.cli ARGS`` to its end, forked from a warm interpreter, for the tests that only read
a run's output and files.

Most of a short CLI run is interpreter start-up: importing torch, Hydra and the harness costs ~3 s of CPU per
process. multiprocessing's forkserver imports them once per test worker; each run is a fork of that server set
up as a fresh ``python -m kfac_bench.cli`` would be (``sys.argv``, environment, working directory, default
start method, stdout/stderr as files at the descriptor level), which runs :func:`kfac_bench.cli.main` and its
``atexit`` handlers and exits with its status. Tests of signals, preemption, supervision and run-directory
locking start real processes instead (:mod:`tests.harness.fault_util`).

``KFAC_BENCH_TEST_FORK_CLI=0`` runs a real subprocess instead (to rule this out when a test fails).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ENV_SWITCH", "run_cli_process"]

ENV_SWITCH = "KFAC_BENCH_TEST_FORK_CLI"
#: What every CLI run imports, loaded once by the server (the BERT and Mask R-CNN recipes' modules too).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # imported when the first optimizer is built
    "torch.utils.tensorboard",
    "torchvision",
    "hydra",
    "omegaconf",
    "kfac_bench.cli",
    "kfac_bench.config.compose",
    "kfac_bench.kfac.checkpoint",
    "kfac_bench.train.run",
    "kfac_bench.models.bert",
    "kfac_bench.data.bert",
    "timm.optim",
    "torchvision.models.detection",
]
#: Environment variables the preloaded hub libraries (transformers, huggingface_hub) read when imported.
_HUB_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")

_server: tuple[mp.context.ForkServerContext, dict[str, str]] | None = None


def _hub_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What the hub libraries see of ``env`` when imported (``HF_HUB_OFFLINE=1`` unless set, as
    ``kfac_bench.models.bert`` sets it before importing transformers)."""
    seen = {k: v for k, v in env.items() if k.startswith(_HUB_PREFIXES)}
    seen.setdefault("HF_HUB_OFFLINE", "1")
    return seen


def _server_for(env: Mapping[str, str]) -> mp.context.ForkServerContext | None:
    """The fork server (started on first use), or None for a real subprocess: switched off, or a run whose
    hub settings differ from those the server imported the hub libraries under."""
    global _server
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if _server is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _server = ctx, _hub_environment(os.environ)
    ctx, hub = _server
    return ctx if _hub_environment(env) == hub else None


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` gives the interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(args: Sequence[str], cwd: str, env: Mapping[str, str], out: str, err: str) -> None:
    """The forked run: a fresh ``python -m kfac_bench.cli ARGS`` from here on."""
    mp.set_start_method(None, force=True)  # a fresh interpreter's (fork), not the server's
    # The heap inherited from the server goes to the permanent generation: the run's collections skip it
    # instead of walking (and so copying) its pages.
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)

    from kfac_bench import cli

    sys.argv = [cli.__file__, *args]
    status = 1
    try:
        status = _exit_status(cli.main(list(args)))
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at exit; os._exit below skips it
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def run_cli_process(
    args: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m kfac_bench.cli ARGS`` in ``cwd`` with exactly ``env``, like :func:`subprocess.run` with
    ``capture_output=True, text=True, timeout=timeout``.

    Raises:
        subprocess.TimeoutExpired: the run did not end within ``timeout`` seconds (it is killed).
    """
    command = [sys.executable, "-m", "kfac_bench.cli", *args]
    server = _server_for(env)
    if server is None:
        return subprocess.run(
            command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory(prefix="kfac-bench-cli-") as files:
        out, err = Path(files, "stdout"), Path(files, "stderr")
        out.touch()
        err.touch()
        proc = server.Process(
            target=_child, args=(list(args), str(cwd), dict(env), str(out), str(err))
        )
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()
        stdout, stderr = (p.read_text(encoding="utf-8", errors="replace") for p in (out, err))
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    assert proc.exitcode is not None
    return subprocess.CompletedProcess(command, proc.exitcode, stdout=stdout, stderr=stderr)
