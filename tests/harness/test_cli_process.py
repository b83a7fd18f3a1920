"""The suite's forked CLI runs (tests/harness/cli_process.py) stand for real ``python -m kfac_bench.cli``
processes: same output and status, and no run forked from a server whose preloaded hub libraries were
imported under other settings than the run's environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import cli_process
from tests.harness.util import TINY, cli_env
from tests.limits import hang_limit


def test_a_forked_run_prints_and_exits_as_the_real_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cli_process.ENV_SWITCH, raising=False)
    env = cli_env()
    for args in (["--version"], ["no-such-command"]):
        real = subprocess.run(
            [sys.executable, "-m", "kfac_bench.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        forked = cli_process.run_cli_process(args, tmp_path, env, 120)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            real.returncode,
            real.stdout,
            real.stderr,
        )
        # The same run started in the background, in a session of its own.
        proc = cli_process.start_cli_process(args, tmp_path, env, start_new_session=True)
        assert isinstance(proc, cli_process.CliProcess)
        assert proc.communicate(timeout=120) == (real.stdout, real.stderr)
        assert proc.returncode == proc.poll() == real.returncode


def test_a_background_run_is_its_own_process_group_and_dies_by_a_signal_as_a_process_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cli_process.ENV_SWITCH, raising=False)
    # A run that waits for its records (the training loop) until it is killed.
    args = ["train", *TINY, "train.epochs=2000", "hydra.run.dir=run"]
    proc = cli_process.start_cli_process(args, tmp_path, cli_env(), start_new_session=True)
    assert isinstance(proc, cli_process.CliProcess)
    try:
        deadline = time.monotonic() + hang_limit(60)
        while not (tmp_path / "run" / "config.yaml").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        assert os.getpgid(proc.pid) == os.getsid(proc.pid) == proc.pid
        assert os.getpgid(proc.pid) != os.getpgid(0)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    finally:
        proc.kill()
    proc.wait(timeout=hang_limit(30))
    assert proc.returncode == -signal.SIGKILL
    proc.send_signal(signal.SIGTERM)  # an ended run ignores signals, as Popen.send_signal does


@pytest.mark.parametrize(
    "change",
    [{"HF_HOME": "/elsewhere"}, {"HF_HUB_OFFLINE": "0"}, {"TRANSFORMERS_VERBOSITY": "info"}],
)
def test_a_run_with_other_hub_settings_is_a_real_subprocess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict[str, str]
) -> None:
    calls: list[dict[str, Any]] = []

    def recorded(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(kwargs)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cli_process.subprocess, "run", recorded)
    env = {**cli_env(), **change}
    cli_process.run_cli_process(["--version"], tmp_path, env, 120)
    assert len(calls) == 1 and calls[0]["env"] == env
    # The suite's own settings are the server's: that run is forked.
    done = cli_process.run_cli_process(["--version"], tmp_path, cli_env(), 120)
    assert len(calls) == 1 and done.returncode == 0 and done.stdout.startswith("kfac-bench ")
