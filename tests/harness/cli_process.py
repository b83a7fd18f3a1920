"""Run ``python -m kfac_bench.cli ARGS`` as a process forked from a warm interpreter.

Most of a short CLI run in the suite is interpreter start-up: importing torch, Hydra and the harness takes
~3 s of CPU per process, and the suite starts well over a hundred of them on a 2-core machine. The standard
library's forkserver (:mod:`multiprocessing`) imports those modules once per test worker; each run is then a
fork of that server which sets up what a fresh ``python -m kfac_bench.cli`` would see (``sys.argv``, the
environment, the working directory, multiprocessing's default start method, stdout/stderr as files at the
descriptor level, so the processes it starts write there too), runs :func:`kfac_bench.cli.main`, prints an
uncaught exception's traceback as the interpreter does, runs the ``atexit`` handlers and exits with the
status. It is still a separate process (its own signals, run lock, process group membership and exit), only
without paying the imports again.

:func:`start_cli_process` starts such a run in the background for the tests that signal a run or wait for
its records: it answers the part of :class:`subprocess.Popen` they use (``pid``, ``poll``, ``wait``,
``send_signal``, ``kill``, ``communicate``, ``returncode``), optionally in a session of its own
(``start_new_session``, the process group a terminal or ``timeout`` signals) or under resource limits.
Its command line in ``/proc`` is the fork server's; the processes it starts (torchrun's ranks) have their own.

``KFAC_BENCH_TEST_FORK_CLI=0`` runs a real ``subprocess`` instead (to rule this out when a test fails).
"""

from __future__ import annotations

import atexit
import functools
import gc
import multiprocessing as mp
import os
import resource
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["ENV_SWITCH", "CliProcess", "Running", "run_cli_process", "start_cli_process"]

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


def _child(
    args: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    out: str,
    err: str,
    new_session: bool = False,
    rlimits: Mapping[int, tuple[int, int]] | None = None,
) -> None:
    """The forked run: a fresh ``python -m kfac_bench.cli ARGS`` from here on (what ``subprocess``'s
    ``start_new_session`` and a ``preexec_fn`` setting ``rlimits`` would have done, done first)."""
    if new_session:
        os.setsid()
    _set_limits(rlimits)
    # A process the server forks inherits multiprocessing's "forkserver" start method: the run's own
    # processes (DataLoader workers) would then be the server's children, outside the run's process group.
    # A fresh interpreter has none set (fork, on Linux).
    mp.set_start_method(None, force=True)
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


def _server_for(env: Mapping[str, str]) -> mp.context.ForkServerContext | None:
    """The fork server to fork a run with environment ``env`` from, or None for a real subprocess (switched
    off, or a run that would import the hub libraries under other settings than the server did)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    server, hub = _forkserver()
    return server if _hub_environment(env) == hub else None


class CliProcess:
    """A forked CLI run in the background: the part of :class:`subprocess.Popen` (``text=True``, output
    captured) that the tests use. Its output goes to files, read by :meth:`communicate`."""

    def __init__(
        self,
        server: mp.context.ForkServerContext,
        args: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        new_session: bool,
        rlimits: Mapping[int, tuple[int, int]] | None,
    ) -> None:
        self.args = _command(args)
        self._files = tempfile.TemporaryDirectory(prefix="kfac-bench-cli-")
        self._out, self._err = Path(self._files.name, "stdout"), Path(self._files.name, "stderr")
        self._out.touch()
        self._err.touch()
        self._proc = server.Process(
            target=_child,
            args=(list(args), str(cwd), dict(env), str(self._out), str(self._err)),
            kwargs={"new_session": new_session, "rlimits": dict(rlimits or {})},
        )
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # negative: killed by that signal, as subprocess reports it

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.returncode is None:
            assert timeout is not None
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return (
            self._out.read_text(encoding="utf-8", errors="replace"),
            self._err.read_text(encoding="utf-8", errors="replace"),
        )


#: A CLI run in the background: forked, or a real subprocess.
Running = CliProcess | subprocess.Popen[str]


def start_cli_process(
    args: Sequence[str],
    cwd: Path,
    env: Mapping[str, str],
    start_new_session: bool = False,
    rlimits: Mapping[int, tuple[int, int]] | None = None,
) -> Running:
    """``python -m kfac_bench.cli ARGS`` in the background in ``cwd`` with exactly ``env``, like
    :class:`subprocess.Popen` with ``stdout=PIPE, stderr=PIPE, text=True`` (and ``start_new_session``;
    ``rlimits``: :func:`resource.setrlimit` limits set before the run starts)."""
    server = _server_for(env)
    if server is not None:
        return CliProcess(server, args, cwd, env, start_new_session, rlimits)
    return subprocess.Popen(
        _command(args),
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=start_new_session,
        **_preexec(rlimits),
    )


def _command(args: Sequence[str]) -> list[str]:
    """The command line of the run a forked run stands for."""
    return [sys.executable, "-m", "kfac_bench.cli", *args]


def _set_limits(rlimits: Mapping[int, tuple[int, int]] | None) -> None:
    """:func:`resource.setrlimit` for each of ``rlimits`` in this process."""
    for which, limits in (rlimits or {}).items():
        resource.setrlimit(which, limits)


def _preexec(rlimits: Mapping[int, tuple[int, int]] | None) -> dict[str, Callable[[], None]]:
    """``preexec_fn`` for a real subprocess under ``rlimits`` (none without limits)."""
    return {"preexec_fn": functools.partial(_set_limits, rlimits)} if rlimits else {}


def run_cli_process(
    args: Sequence[str],
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
    rlimits: Mapping[int, tuple[int, int]] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m kfac_bench.cli ARGS`` in ``cwd`` with exactly ``env``, like :func:`subprocess.run` with
    ``capture_output=True, text=True, timeout=timeout`` (``rlimits`` as for :func:`start_cli_process`).

    Raises:
        subprocess.TimeoutExpired: the run did not end within ``timeout`` seconds (it is killed).
    """
    server = _server_for(env)
    if server is None:
        return subprocess.run(
            _command(args),
            cwd=cwd,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            **_preexec(rlimits),
        )
    proc = CliProcess(server, args, cwd, env, False, rlimits)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from exc
    assert proc.returncode is not None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout=out, stderr=err)
