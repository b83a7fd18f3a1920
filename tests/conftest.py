"""Suite-wide settings: every test's pytest-timeout limit is a hang limit, scaled like the rest; one
intra-op thread per test process.

See tests/limits.py.
"""

from __future__ import annotations

import pytest

from tests.limits import hang_limit

#: Seconds each of the slowest test files took in a full run (``pytest --junitxml``, summed per file): a
#: scheduling hint only. ``make test`` hands whole files to its two workers (``--dist loadfile``) in
#: collection order, so the suite ends when the last long file does; starting the longest files first
#: (longest processing time first) keeps both workers busy to the end. A file missing here runs after them.
FILE_SECONDS = {
    "tests/benchmarks/test_gpu_check.py": 110,
    "tests/harness/test_faults_preempt.py": 95,
    "tests/recipes/test_bert_recipes.py": 51,
    "tests/harness/test_faults_elastic.py": 47,
    "tests/recipes/test_bert_squad_recipe.py": 29,
    "tests/recipes/test_detection_recipes.py": 28,
    "tests/harness/test_faults_launcher.py": 27,
    "tests/harness/test_faults_slurm.py": 27,
    "tests/recipes/test_image_recipes.py": 26,
    "tests/config/test_compose.py": 20,
    "tests/kfac/test_distributed.py": 18,
    "tests/harness/test_hydra_flags.py": 17,
    "tests/harness/test_cli.py": 16,
    "tests/benchmarks/test_digits_grid.py": 15,
    "tests/harness/test_agent_config_dir.py": 13,
    "tests/harness/test_launch.py": 13,
    "tests/harness/test_faults_config.py": 12,
    "tests/harness/test_plain_torchrun.py": 11,
    "tests/harness/test_wheel.py": 11,
    "tests/harness/test_run_dir_quoting.py": 10,
    "tests/harness/test_faults_rundir.py": 9,
    "tests/harness/test_faults_checkpoints.py": 8,
    "tests/plan/test_against_engine.py": 8,
    "tests/harness/test_launch_gpus.py": 8,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put a scaled ``timeout`` marker in front of each test's own (or the ini default of pyproject.toml);
    run the longest files first (:data:`FILE_SECONDS`; the sort is stable, so a file's tests stay together
    and in order)."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.partition("::")[0], 0))
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
