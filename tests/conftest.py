"""Suite-wide settings: every test's pytest-timeout limit is a hang limit, scaled like the rest; one
intra-op thread per test process.

See tests/limits.py.
"""

from __future__ import annotations

import pytest

from tests.limits import hang_limit


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put a scaled ``timeout`` marker in front of each test's own (or the ini default of pyproject.toml)."""
    default = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = default
        if marker is not None:
            seconds = float(
                marker.args[0] if marker.args else marker.kwargs.get("timeout", default)
            )
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(hang_limit(seconds)), append=False)


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> None:
    """Every test process computes on one thread (the CLI and rank subprocesses get ``OMP_NUM_THREADS=1``
    from ``tests.harness.util.cli_env``). Two pytest workers each spinning torch's default thread pool on a
    shared 2-core machine oversubscribe it: under load a 2-step MobileNet test took minutes instead of a
    second. Tests that measure thread counts set their own."""
    import torch

    torch.set_num_threads(1)
