"""torchrun with preemption:
``python -m kfac_bench.launcher.agent TORCHRUN_ARGS -m kfac_bench.cli train ...``.

torchrun's agent turns SIGTERM into an abort (its workers get SIGTERM and 30 s, then SIGKILL), dies of
SIGUSR1 (leaving its ranks to train on unsupervised), and reports a rank's exit status 75 as a failure,
which ``--max-restarts`` answers with a restart. :func:`run_torchrun` runs the same agent in this process,
with these differences:

* SIGTERM, SIGINT (Ctrl-C), SIGUSR1 and SIGUSR2 are passed on to the ranks (each the same signal; ranks
  started later get it too) and the agent keeps supervising them while they finish the step and checkpoint
  (``TORCHELASTIC_SIGNALS_TO_HANDLE`` leaves these to us). A second Ctrl-C aborts the agent.
* A preempted rank exits 0 under torchrun (no restart) after rank 0 wrote the run directory's
  ``preempted`` marker (:mod:`kfac_bench.launcher.rundir`); the agent returns :data:`EXIT_REQUEUE` exactly
  when the marker is there.
* A rank's one-line user error (exit 2 on every rank) stays exit 2.
* The ranks die with this process: a SIGKILL of the agent (which releases the run directory's lock) kills
  them too, so none trains on unsupervised beside a second run (:mod:`kfac_bench.launcher.agent_tie`).

``launcher=torchrun`` calls :func:`run_torchrun` in the Hydra job's process; ``launch/slurm.sbatch`` and
``launch/torchrun_multinode.sh`` start this module on every node, which first checks the config (bounds,
targets, device), that no other run holds the run directory and that its recorded config matches, so a
mistake is one line before any rank starts. A mistake every node finds alike (the composed config, the
run directory's lock, links and recorded config, a world that cannot keep the run's global batch) is
printed by the first task of the ``srun`` step only (``SLURM_PROCID`` 0): every node's agent stops with its
status, and the job's one output file holds the line once, not once per node. A node's own devices are
checked and reported on each node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kfac_bench.errors import UserError
from kfac_bench.launcher import rundir
from kfac_bench.launcher.agent_tie import AGENT_PID_ENV
from kfac_bench.launcher.signals import EXIT_REQUEUE, PreemptionFlag

__all__ = [
    "child_pids",
    "main",
    "run_dir_of",
    "run_torchrun",
    "torchrun_world_size",
    "world_size_of",
]

#: Signals torchrun's agent may keep for itself: a lost terminal, SIGQUIT. Preemption signals are ours.
_AGENT_SIGNALS = "SIGHUP,SIGQUIT"


def child_pids(parent: int | None = None) -> list[int]:
    """Processes whose parent is ``parent`` (default: this one), from ``/proc``. torchrun starts each rank
    as a direct child in a session of its own, so signals sent to our process group never reach them."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            pids.append(int(entry.name))
    return pids


class _Forwarder:
    """Sends a received signal to every child now, and to children that appear later (ranks that were
    being started or restarted), until :meth:`stop`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.sent: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, signum: int) -> None:
        self.signum = signum
        self.sent.clear()
        self._send()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="kfac-forward", daemon=True)
            self._thread.start()

    def _send(self) -> None:
        signum = self.signum
        if signum is None:
            return
        for pid in child_pids():
            if pid not in self.sent:
                self.sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self._send()

    def stop(self) -> None:
        self._stop.set()


def run_torchrun(args: Sequence[str], run_dir: Path) -> int:
    """Run ``torch.distributed.run`` with ``args`` in this process, forwarding preemption to the ranks.

    Returns:
        0 when the ranks finished, :data:`EXIT_REQUEUE` when they stopped for preemption with a
        checkpoint, 2 when every failed rank reported a user error, 1 for any other failure.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    rundir.clear_preempted(run_dir)  # a marker from an earlier attempt must not requeue this one
    forward = _Forwarder()
    flag = PreemptionFlag(forward=forward).install()
    saved = {key: os.environ.get(key) for key in ("TORCHELASTIC_SIGNALS_TO_HANDLE", AGENT_PID_ENV)}
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = _AGENT_SIGNALS
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks die with this process
    try:
        torchrun_main(list(args))
        status = 0
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        status = 2 if codes == {UserError.exit_code} else 1
    except SignalException as exc:
        status = 128 + int(exc.sigval)
    finally:
        forward.stop()
        flag.restore()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if rundir.was_preempted(run_dir):
        status = EXIT_REQUEUE
        flag.hand_back()
    return status


def run_dir_of(args: Sequence[str]) -> Path | None:
    """The run directory named by a ``hydra.run.dir=`` argument (the last one wins)."""
    found = None
    for arg in args:
        if arg.startswith("hydra.run.dir="):
            found = Path(_override_value(arg)).resolve()
    return found


def _override_value(arg: str) -> str:
    """The value of override ``arg`` as Hydra reads it (quoted or not), OmegaConf's escapes undone.

    Raises:
        UserError: Hydra cannot parse it (a path with spaces, ``,`` or ``=`` must be quoted).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    key, _, raw = arg.partition("=")
    try:
        value = OverridesParser.create().parse_override(arg).value()
        if isinstance(value, str):
            return str(OmegaConf.create({"v": value}).v)
    except (HydraException, OmegaConfBaseException, ValueError):
        pass
    raise UserError(
        f"{key}={raw} is not one path in Hydra's override syntax; quote it: "
        f"`python -m kfac_bench.launcher.torchrun DIR` prints {key}='DIR' with the quoting it needs"
    )


def _train_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The ``kfac-bench train`` (flags with their values, overrides) after ``-m kfac_bench.cli train``, split
    as Hydra splits them (``--config-dir DIR``: DIR is the flag's, not an override)."""
    from kfac_bench.config.command_line import split_args

    args = list(args)
    for i in range(len(args) - 2):
        if args[i : i + 3] == ["-m", "kfac_bench.cli", "train"]:
            return split_args(args[i + 3 :])
    raise UserError("the command must end in -m kfac_bench.cli train [overrides ...]")


def world_size_of(args: Sequence[str]) -> int:
    """The ranks torchrun's ``args`` start over all nodes (the most of an elastic ``--nnodes=MIN:MAX``):
    :func:`~kfac_bench.launcher.preflight.job_world`'s.

    Raises:
        UserError: ``--nproc-per-node=gpu`` on a machine without a CUDA device.
    """
    from kfac_bench.launcher.preflight import job_world

    return job_world(None, torchrun_args=args).size


def torchrun_world_size(args: Sequence[str]) -> int | None:
    """The ranks torchrun's ``args`` start when that is one fixed number, None for an elastic
    ``--nnodes=MIN:MAX`` (the ranks then check the world they find themselves)."""
    from kfac_bench.launcher.preflight import job_world

    world = job_world(None, torchrun_args=args)
    return world.size if world.fixed else None


def _preflight(args: Sequence[str], run_dir: Path) -> Any:
    """Check the job before this node starts a rank (config, device, run directory, world); returns the
    composed config. The user's ``--config-dir`` (any of Hydra's forms) is on its search path, as on the
    ranks'."""
    from kfac_bench.config.command_line import config_dirs_of
    from kfac_bench.config.compose import compose_run
    from kfac_bench.launcher.preflight import check_run, job_world

    flags, overrides = _train_args(args)
    overrides = [o for o in overrides if not o.startswith("hydra.")]
    with _said_once():
        cfg = compose_run(overrides, config_dirs=config_dirs_of(flags))
        world = job_world(cfg, torchrun_args=args)  # one reading for both checks
    check_run(cfg, world_size=world.size)  # this node's devices: each node reports its own
    with _said_once():  # the shared run directory: every node finds the same
        rundir.probe_lock(run_dir)
        rundir.check_planted(run_dir)
        rundir.check_config(run_dir, cfg)
        if world.fixed:
            from kfac_bench.checkpoint.elastic import check_launch

            check_launch(run_dir, cfg, world.size)  # before this node starts a rank
    return cfg


class _SaidByFirstNode(UserError):
    """A user error that the first node's agent prints; this node stops with its status, silently."""

    def __init__(self, exc: UserError) -> None:
        super().__init__(str(exc))
        self.exit_code = exc.exit_code


@contextlib.contextmanager
def _said_once() -> Any:
    """Turn a user error that every node finds alike into :class:`_SaidByFirstNode` on every task of the
    ``srun`` step but the first, whose output goes into the same job output file."""
    try:
        yield
    except UserError as exc:
        if os.environ.get("SLURM_PROCID", "0") != "0":
            raise _SaidByFirstNode(exc) from None
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kfac_bench.launcher.agent``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # torchrun's agent logs (rank failures, closing signals) go to stdout: stderr keeps one-line errors.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING)
    try:
        run_dir = run_dir_of(args)
        if run_dir is None:
            raise UserError("pass the run directory as hydra.run.dir=DIR (the ranks share it)")
        rundir.check_run_dir_path(run_dir)
        _preflight(args, run_dir)
    except UserError as exc:
        if not isinstance(exc, _SaidByFirstNode):
            print(f"kfac-bench: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return run_torchrun(args, run_dir)


if __name__ == "__main__":
    sys.exit(main())
