"""``kfac-bench`` dispatches to one module per subcommand; adding one is a module plus a registry line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kfac_bench.commands as commands
from kfac_bench.cli import main, usage
from tests.harness.util import cli_env


def test_every_registered_command_has_a_module_with_summary_and_main() -> None:
    for name in commands.COMMANDS:
        module = commands.load(name)
        assert name in module.SUMMARY and callable(module.main), name
        assert module.SUMMARY.rstrip() in usage()


def test_every_command_module_is_registered() -> None:
    folder = Path(commands.__file__).parent
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert modules == set(commands.COMMANDS.values())


def test_cli_dispatches_to_the_commands_main_and_reports_user_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kfac-bench: error: run directory '{tmp_path / 'nope'}' does not exist"]


def test_help_imports_neither_torch_nor_hydra() -> None:
    code = (
        "import sys; from kfac_bench.cli import usage; usage(); "
        "print(sorted(m for m in ('torch', 'hydra', 'omegaconf') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True
    )
    assert out.stdout.strip() == "[]"
