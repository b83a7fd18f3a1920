"""Two runs started at the same moment in one fresh directory: one runs, the other exits 2 with one line and
leaves no trace (Hydra's ``.hydra/`` files are the winner's: the lock is taken before Hydra writes them)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import yaml

from kfac_bench.launcher import rundir
from tests.harness.fault_util import one_error_line, processes_mentioning, start
from tests.harness.util import TINY
from tests.limits import hang_limit

pytestmark = pytest.mark.slow


def test_the_loser_of_two_simultaneous_starts_leaves_no_trace(tmp_path: Path) -> None:
    common = [*TINY, "train.epochs=2000", "train.eval_every_steps=3", "hydra.run.dir=run"]
    procs = {seed: start("train", *common, f"train.seed={seed}", cwd=tmp_path) for seed in (1, 2)}
    try:
        deadline = time.monotonic() + hang_limit(120)
        while all(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        losers = [seed for seed, p in procs.items() if p.poll() is not None]
        assert len(losers) == 1, "neither run ended"
        loser = losers[0]
        winner = 3 - loser
        _, err = procs[loser].communicate()
        assert procs[loser].returncode == 2, err[-3000:]
        line = one_error_line(err)
        assert "is in use by another run" in line or "holds a run with another config" in line
        run_dir = tmp_path / "run"
        # Everything in the directory is the winner's, now and after it stops.
        deadline = time.monotonic() + hang_limit(90)
        while not (run_dir / rundir.CONFIG_FILE).is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[winner].send_signal(signal.SIGTERM)
        _, err = procs[winner].communicate(timeout=hang_limit(60))
        assert procs[winner].returncode == 75, err[-3000:]
    finally:
        for p in procs.values():
            p.kill()
    hydra_config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert hydra_config["train"]["seed"] == winner
    assert f"train.seed={winner}" in yaml.safe_load(
        (run_dir / ".hydra" / "overrides.yaml").read_text()
    )
    recorded = yaml.safe_load((run_dir / rundir.CONFIG_FILE).read_text())
    assert recorded["train"]["seed"] == winner
    assert not processes_mentioning(str(run_dir))
