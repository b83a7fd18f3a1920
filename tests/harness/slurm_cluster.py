"""A single-node SLURM for the ``slurm`` tests: munged, slurmctld and slurmd on this machine, configured here.

Debian's ``slurm-wlm`` and ``munge`` packages (``.ci/slurm-install`` installs them, as root) with a
``slurm.conf`` of its own under :data:`HOME` (clients find it through ``SLURM_CONF``; no system file is
touched): one node with this machine's CPUs and memory (``slurmd -C``), one partition, ``select/cons_tres``
with cores and memory as consumable resources (each core shared by up to 4 jobs, so that the tests' jobs,
submitted together, run together), ``proctrack/linuxproc`` (no cgroup set-up needed in a
container), no accounting, and short timers so that requeues, dependencies and kills take seconds.

Each home (``KFAC_BENCH_SLURM_HOME``, default ``/tmp/kfac-bench-slurm``) is its own cluster: its ports are
derived from the home's path (:func:`derived_ports`, between 20000 and 39999, clear of a site's own SLURM on
6817/6818), and where either is taken when the cluster starts, free ports are chosen instead; the ports in
use are those in its ``slurm.conf``. A cluster is *this home's* only when its own daemons run (the pids in
its pid files, alive and named as the daemon) and the controller that answers is the one keeping its state
in this home (``scontrol show config``); a controller of another home answering on a port is never adopted.

``python -m tests.harness.slurm_cluster up|down|status`` starts (or finds running), stops, or reports it; the
tests' session fixture (tests/harness/test_slurm.py) does ``up`` and, when it started the daemons itself,
``down`` at its end. ``up`` is idempotent: this home's daemons already answering are reused, stale pid
files and dead daemons are replaced; a daemon that dies while starting (a port taken, a bad config) stops
``up`` with its log.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

#: Where the configuration, state, spool, pid files and logs live (the same for every run: reusable).
HOME = Path(os.environ.get("KFAC_BENCH_SLURM_HOME", "/tmp/kfac-bench-slurm"))
CONF = HOME / "slurm.conf"
PARTITION = "kfacbench"
DAEMONS = ("munged", "slurmctld", "slurmd")
MUNGE_SOCKET = HOME / "munge" / "munge.socket.2"


def missing() -> str | None:
    """Why this machine cannot run the cluster (one line), or None."""
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"SLURM not installed ({tool} not found; as root: .ci/slurm-install)"
    if os.geteuid() != 0 and not _answers():
        return "SLURM daemons not running and this user cannot start them (run the tests as root)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the cluster's client settings."""
    e = dict(os.environ if base is None else base)
    e["SLURM_CONF"] = str(CONF)
    return e


def _node() -> tuple[str, int, int]:
    """(node name, CPUs, memory in MB) of this machine, as slurmd sees it."""
    out = subprocess.run([_tool("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return socket.gethostname().split(".")[0], int(fields["CPUs"]), int(fields["RealMemory"])


def derived_ports(home: Path) -> tuple[int, int]:
    """(slurmctld, slurmd) ports of the cluster at ``home``: two neighbours from a hash of its path, so
    that clusters of different homes do not collide."""
    digest = hashlib.sha256(str(Path(home).absolute()).encode()).digest()
    base = 20000 + 2 * (int.from_bytes(digest[:4], "big") % 10000)
    return base, base + 1


def _free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` on every address (as slurmctld and slurmd do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _any_free() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def choose_ports(home: Path) -> tuple[int, int]:
    """The home's derived ports where both are free, else two free ports."""
    ports = derived_ports(home)
    if all(_free(p) for p in ports):
        return ports
    first = _any_free()
    second = _any_free()
    while second == first:
        second = _any_free()
    return first, second


def conf_ports() -> tuple[int, int] | None:
    """The ports :data:`CONF` names, or None where it is missing or names none."""
    try:
        text = CONF.read_text()
    except OSError:
        return None
    found = [re.search(rf"^{key}=(\d+)$", text, re.M) for key in ("SlurmctldPort", "SlurmdPort")]
    return (int(found[0].group(1)), int(found[1].group(1))) if found[0] and found[1] else None


def config(ports: tuple[int, int]) -> str:
    """``slurm.conf`` of this home with the (slurmctld, slurmd) ``ports``."""
    name, cpus, memory = _node()
    memory = max(memory - 1024, 512)  # leave the OS some room below what slurmd reports
    return f"""\
ClusterName=kfacbench
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={MUNGE_SOCKET}
CredType=cred/munge
StateSaveLocation={HOME}/state
SlurmdSpoolDir={HOME}/spool
SlurmctldPidFile={HOME}/slurmctld.pid
SlurmdPidFile={HOME}/slurmd.pid
SlurmctldLogFile={HOME}/slurmctld.log
SlurmdLogFile={HOME}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
JobRequeue=1
NodeName={name} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName={PARTITION} Nodes={name} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _pid(name: str) -> int | None:
    path = HOME / f"{name}.pid"
    try:
        pid = int(path.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    comm = Path(f"/proc/{pid}/comm")
    return pid if comm.exists() and comm.read_text().strip() == name else None


def _ask(tool: str, *args: str) -> subprocess.CompletedProcess[str] | None:
    """``tool args`` against this home's cluster (its output as text), None where it could not run or hung."""
    try:
        return subprocess.run(
            [_tool(tool), *args], env=env(), capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def _answers() -> bool:
    """Whether slurmctld answers and the node takes jobs."""
    out = _ask("sinfo", "-h", "-N", "-o", "%t")
    if out is None:
        return False
    # idle, mix, alloc or comp (completing: a job ending); a suffix such as '*' (not responding) or a down,
    # drained or invalid node is not taking jobs.
    return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc", "comp")


def ours() -> bool:
    """Whether the controller that answers at :data:`CONF`'s address keeps its state in this home (it is
    this home's slurmctld, not another cluster's on the same port)."""
    out = _ask("scontrol", "show", "config")
    if out is None:
        return False
    found = re.search(r"^StateSaveLocation\s*=\s*(\S+)", out.stdout, re.M)
    return out.returncode == 0 and found is not None and found.group(1) == str(HOME / "state")


def running() -> bool:
    """This home's daemons are alive and its controller answers, with the node taking jobs."""
    return all(_pid(d) for d in DAEMONS) and _answers() and ours()


#: Log lines of a daemon that cannot start (slurmctld and slurmd say "fatal" before they exit).
_FATAL = re.compile(r"fatal|Address already in use|bind.*failed", re.I)


def _logs() -> str:
    return "".join(
        f"\n--- {p.name}:\n" + p.read_text(errors="replace")[-2000:]
        for p in sorted(HOME.glob("*.log"))
    )


def _wait(what: str, ready: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        failed = [
            p.name for p in HOME.glob("slurm*.log") if _FATAL.search(p.read_text(errors="replace"))
        ]
        if failed:
            raise RuntimeError(f"SLURM: {what}: {', '.join(failed)} reports a failure{_logs()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"SLURM: {what} not ready after {timeout:.0f} s{_logs()}")
        time.sleep(0.2)


def up() -> bool:
    """Start whatever of the cluster is not running; True when this call started slurmctld (its caller
    then owns the cluster and stops it with :func:`down`)."""
    ports = conf_ports()
    if ports is not None and running() and CONF.read_text() == config(ports):
        return False
    down()
    for d in ("state", "spool"):  # a fresh controller: no jobs or node states of an earlier cluster
        shutil.rmtree(HOME / d, ignore_errors=True)
    for d in ("state", "spool", "munge"):
        (HOME / d).mkdir(parents=True, exist_ok=True)
    for log in HOME.glob("*.log"):  # the failures _wait looks for are this start's
        log.unlink()
    CONF.write_text(config(choose_ports(HOME)))
    (HOME / "munge").chmod(0o755)
    subprocess.run(
        [
            _tool("munged"),
            "--force",
            f"--socket={MUNGE_SOCKET}",
            f"--pid-file={HOME / 'munged.pid'}",
            f"--log-file={HOME / 'munged.log'}",
            f"--seed-file={HOME / 'munge' / 'munged.seed'}",
        ],
        check=True,
    )
    _wait("munged", lambda: MUNGE_SOCKET.exists())
    e = env()
    subprocess.run([_tool("slurmctld"), "-f", str(CONF)], env=e, check=True)
    subprocess.run([_tool("slurmd"), "-f", str(CONF)], env=e, check=True)
    # Ready when this home's own daemons run and the controller answering is this home's: never a
    # cluster of another home that happens to answer on the port.
    _wait("the node", running)
    return True


def down() -> None:
    """Stop the cluster's daemons (those of :data:`HOME`'s pid files) and any job still running on it."""
    if _pid("slurmctld"):
        subprocess.run(
            [_tool("scancel"), "--full", f"--partition={PARTITION}"],
            env=env(),
            capture_output=True,
            timeout=30,
            check=False,
        )
    for name in reversed(DAEMONS):
        pid = _pid(name)
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _pid(name) == pid and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid(name) == pid:
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    if command == "up":
        why = missing()
        if why:
            print(f"slurm tests will be skipped: {why}")
            return 0
        print("SLURM started" if up() else "SLURM already running", f"(SLURM_CONF={CONF})")
    elif command == "down":
        down()
    elif command == "status":
        print(
            "running" if running() else "not running", f"(SLURM_CONF={CONF}, ports {conf_ports()})"
        )
        return 0 if running() else 1
    else:
        print("usage: python -m tests.harness.slurm_cluster up|down|status", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
