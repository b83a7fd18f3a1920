"""Suite-wide settings: every test's pytest-timeout limit is a hang limit, scaled like the rest
(tests/limits.py); the end-to-end files start first; one intra-op thread per test process."""

from __future__ import annotations

import pytest

from tests.limits import hang_limit

#: Markers of the tests that start processes (the CLI, torchrun, launch scripts, gloo ranks): the long ones.
LONG_MARKERS = ("slow", "distributed")


def _file(item: pytest.Item) -> str:
    return item.nodeid.partition("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put a scaled ``timeout`` marker in front of each test's own (or the ini default of pyproject.toml);
    start the files holding a :data:`LONG_MARKERS` test first.

    ``make test`` hands whole files to its workers in collection order (``--dist loadfile``), so the suite
    ends when the last long file does: with the long files first, the many short ones fill in behind them
    and the workers end together. The sort is stable, so a file's tests stay together and in order.
    """
    long_files = {_file(i) for i in items if any(i.get_closest_marker(m) for m in LONG_MARKERS)}
    items.sort(key=lambda item: _file(item) not in long_files)
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
    from ``tests.harness.util.cli_env``): each worker spinning torch's default thread pool oversubscribes
    the cores the workers share, and a loaded machine then takes minutes for a second's work. Tests that
    measure thread counts set their own."""
    import torch

    torch.set_num_threads(1)
