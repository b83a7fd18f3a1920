"""The test SLURM of one home never answers for another's: each home's ports come from its path (or are
free ones when those are taken), and ``up`` is ready only when the home's own daemons run and the answering
controller keeps its state in that home. The two-cluster cases start real daemons (``slurm``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import slurm_cluster
from tests.harness.util import REPO


def test_ports_are_derived_from_the_home_and_stay_clear_of_each_other() -> None:
    homes = [Path(f"/tmp/kfac-bench-slurm-{i}") for i in range(50)]
    ports = [slurm_cluster.derived_ports(h) for h in homes]
    assert ports[0] == slurm_cluster.derived_ports(
        homes[0]
    )  # stable: a running cluster is found again
    assert all(20000 <= a < 40000 and b == a + 1 for a, b in ports)
    assert (
        len({p for pair in ports for p in pair}) >= 95
    )  # distinct homes, (nearly always) distinct ports


def test_a_taken_port_moves_the_cluster_to_free_ones(tmp_path: Path) -> None:
    derived = slurm_cluster.derived_ports(tmp_path)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            taken.bind(("", derived[0]))
        except OSError:
            pytest.skip(f"port {derived[0]} is in use here already")
        taken.listen()
        chosen = slurm_cluster.choose_ports(tmp_path)
    assert derived[0] not in chosen and chosen[0] != chosen[1]


def _cluster(home: Path, command: str, code: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m tests.harness.slurm_cluster COMMAND`` for ``home`` (or ``code`` run in its place)."""
    env = {**os.environ, "KFAC_BENCH_SLURM_HOME": str(home), "PYTHONPATH": str(REPO)}
    argv = ["-c", code] if code else ["-m", "tests.harness.slurm_cluster", command]
    return subprocess.run(
        [sys.executable, *argv], env=env, cwd=REPO, capture_output=True, text=True, timeout=180
    )


@pytest.fixture
def two_homes(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    why = slurm_cluster.missing()
    if why is not None:
        pytest.skip(why)
    a, b = tmp_path / "a", tmp_path / "b"
    try:
        yield a, b
    finally:
        for home in (b, a):
            _cluster(home, "down")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_second_home_runs_its_own_cluster_and_never_adopts_the_first(
    two_homes: tuple[Path, Path],
) -> None:
    a, b = two_homes
    for home in (a, b):
        started = _cluster(home, "up")
        assert started.returncode == 0 and "SLURM started" in started.stdout, started.stderr
    for home in (a, b):
        status = _cluster(home, "status")
        assert status.returncode == 0 and status.stdout.startswith("running"), status
    ports = [(h / "slurm.conf").read_text() for h in (a, b)]
    assert ports[0] != ports[1]
    # Forced onto the first cluster's ports, the second's controller cannot bind: up() says so, with its
    # log, instead of reporting "started" because the first cluster answers there.
    _cluster(b, "down")
    taken = (
        "from tests.harness import slurm_cluster as c; from pathlib import Path; "
        f"c.choose_ports = lambda home: c.derived_ports(Path({str(a)!r})) "
        f"if c.conf_ports() is None else c.conf_ports(); "
        f"c.CONF.parent.mkdir(parents=True, exist_ok=True); "
        f"c.CONF.write_text(Path({str(a / 'slurm.conf')!r}).read_text()); c.up()"
    )
    forced = _cluster(b, "", taken)
    assert forced.returncode != 0, forced.stdout
    assert "Address already in use" in forced.stderr or "not ready" in forced.stderr
    assert _cluster(b, "status").returncode == 1  # not running: the first cluster is not its own
    assert _cluster(a, "status").returncode == 0  # and the first one was left alone
