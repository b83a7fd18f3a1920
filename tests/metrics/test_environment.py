"""The run's environment record (``summary.json``'s ``environment``): git tree state in a real temporary
repository, present values or None, and the NVIDIA driver version read from the kernel module's real text."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_git_dirty_follows_the_work_tree(tmp_path: Path) -> None:
    import subprocess

    from kfac_bench.metrics.environment import git_dirty

    assert git_dirty(tmp_path) is None  # not a checkout
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("runs/\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert git_dirty(repo) is False
    (repo / "runs").mkdir()
    (repo / "runs" / "out.json").write_text("{}")  # ignored: still clean
    assert git_dirty(repo) is False
    (repo / "b.py").write_text("y = 2\n")  # untracked, not ignored
    assert git_dirty(repo) is True
    (repo / "b.py").unlink()
    (repo / "a.py").write_text("x = 2\n")  # a tracked file changed
    assert git_dirty(repo) is True


def test_environment_values_are_present_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    from importlib import metadata

    import torch

    from kfac_bench.metrics import environment

    monkeypatch.setattr(environment, "PACKAGES", ("torch", "transformers", "no-such-package-kfb"))
    env = environment.run_environment(torch.device("cpu"))
    assert env["host"] == socket.gethostname()
    assert env["gpu"] is None and env["gpu_driver"] is None  # not a CUDA run
    assert env["cuda"] == torch.version.cuda
    assert env["torch"] == metadata.version("torch")
    assert env["transformers"] == metadata.version("transformers")
    assert env["no-such-package-kfb"] is None
    assert set(env) >= {"git_dirty", "nccl", "python"}


@pytest.mark.parametrize(
    "text, version",
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n"
            "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)\n",
            "535.129.03",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  "
            "(dvs-builder@U16-T02-35-3)  Mon Feb 26 21:24:24 UTC 2024\n",
            "550.54.15",
        ),
    ],
    ids=["proprietary", "open"],
)
def test_driver_version_from_the_kernel_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, version: str
) -> None:
    from kfac_bench.metrics import environment

    (tmp_path / "version").write_text(text)
    monkeypatch.setattr(environment, "_DRIVER_FILE", tmp_path / "version")
    assert environment._driver_version() == version
