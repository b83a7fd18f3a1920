"""Run ``python -m kfac_bench.cli ARGS`` as a process forked from a warm interpreter.

Most of a short CLI run in the suite is interpreter start-up: importing torch, Hydra and the harness takes
~3 s of CPU per process, and the suite starts well over a hundred of them on a 2-core machine. The standard
library's forkserver (:mod:`multiprocessing`) imports those modules once per test worker; each run is then
a fork of that server which sets up what a fresh ``python -m kfac_bench.cli`` would see (``sys.argv``, the
environment, the working directory, stdout/stderr as files at the descriptor level, so the processes it
starts write there too), runs :func:`kfac_bench.cli.main`, prints an uncaught exception's traceback as the
interpreter does, runs the ``atexit`` handlers and exits with the status. It is still a separate process
(its own signals, run lock, process group membership and exit), only without paying the imports again.

``KFAC_BENCH_TEST_FORK_CLI=0`` runs a real ``subprocess`` instead (to rule this out when a test fails).
Tests that signal the CLI or read its output while it runs start it with :mod:`subprocess` themselves.
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
#: What every CLI run imports: loaded once by the fork server. transformers and huggingface_hub read
#: their environment (``HF_HUB_OFFLINE``, ``HF_HOME``, ...) when imported: the server imports them under
#: :func:`_hub_environment` of its own, and a run whose environment differs there is a real subprocess.
_PRELOAD = [
    "torch",
    "torch.distributed",
    # torch.optim imports dynamo when the first optimizer is built: 1.5 of a short run's ~3.5 s.
    "torch._dynamo",
    "torch.utils.tensorboard",
    "torchvision",
    "hydra",
    "omegaconf",
    "kfac_bench.cli",
    "kfac_bench.config.compose",
    "kfac_bench.kfac.checkpoint",
    "kfac_bench.train.run",
    # The BERT recipes' model, shards and LAMB (transformers, h5py, timm: 2.8 s of a run), Mask R-CNN's
    # torchvision detection models (0.4 s).
    "kfac_bench.models.bert",
    "kfac_bench.data.bert",
    "timm.optim",
    "torchvision.models.detection",
]
#: Environment variables read at import by the preloaded libraries (transformers, huggingface_hub).
_HUB_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")

_context: mp.context.ForkServerContext | None = None
#: :func:`_hub_environment` of this process when it started the server (the server's own).
_server_hub: dict[str, str] | None = None


def _hub_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What the preloaded hub libraries see of ``env`` when imported: its ``HF_*`` (and the like) variables,
    with ``HF_HUB_OFFLINE=1`` unless set, as ``kfac_bench.models.bert`` sets it before importing
    transformers."""
    seen = {k: v for k, v in env.items() if k.startswith(_HUB_PREFIXES)}
    seen.setdefault("HF_HUB_OFFLINE", "1")
    return seen


def _forkserver() -> tuple[mp.context.ForkServerContext, dict[str, str]]:
    """The fork server's context (started on its first use, from this process's environment) and the
    hub environment it imported the preloaded modules under."""
    global _context, _server_hub
    if _context is None or _server_hub is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context, _server_hub = ctx, _hub_environment(os.environ)
    return _context, _server_hub


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
    # The heap inherited from the server (torch, transformers, ...: millions of objects) goes to the
    # collector's permanent generation: the run's full collections skip it instead of walking it and
    # writing to (so copying) its pages, which made a run slower the more the server preloads.
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
        status = 1
    finally:
        try:
            atexit._run_exitfuncs()
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
    cmd = [sys.executable, "-m", "kfac_bench.cli", *args]
    forked = os.environ.get(ENV_SWITCH, "1") != "0"
    if forked:
        server, hub = _forkserver()
        # A run that would import the hub libraries under other settings than the server did is not forked.
        forked = _hub_environment(env) == hub
    if not forked:
        return subprocess.run(
            cmd, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory(prefix="kfac-bench-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        proc = server.Process(
            target=_child, args=(list(args), str(cwd), dict(env), str(out), str(err))
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(
                cmd, timeout, output=out.read_text(errors="replace"), stderr=err.read_text()
            )
        status = proc.exitcode
        assert status is not None
        return subprocess.CompletedProcess(
            cmd,
            status,
            stdout=out.read_text(encoding="utf-8", errors="replace"),
            stderr=err.read_text(encoding="utf-8", errors="replace"),
        )
