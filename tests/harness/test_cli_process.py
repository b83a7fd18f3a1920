"""The suite's forked CLI runs (tests/harness/cli_process.py) stand for real ``python -m kfac_bench.cli``
processes: same output and status, and no run forked from a server whose preloaded hub libraries were
imported under other settings than the run's environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import cli_process
from tests.harness.util import cli_env

pytestmark = pytest.mark.slow


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

    monkeypatch.delenv(cli_process.ENV_SWITCH, raising=False)
    monkeypatch.setattr(cli_process.subprocess, "run", recorded)
    env = {**cli_env(), **change}
    cli_process.run_cli_process(["--version"], tmp_path, env, 120)
    assert len(calls) == 1 and calls[0]["env"] == env
    # The suite's own settings are the server's: that run is forked.
    done = cli_process.run_cli_process(["--version"], tmp_path, cli_env(), 120)
    assert len(calls) == 1 and done.returncode == 0 and done.stdout.startswith("kfac-bench ")
