"""``launch/slurm.sbatch`` under a fake SLURM (``srun``/``scontrol`` shims on PATH), for what the real
single-node SLURM of tests/harness/test_slurm.py (preemption, requeue and resume; finished and crashed
jobs) cannot show or where it is absent: a node list of 200k hosts cannot kill the script before ``srun``;
environment and resources are explicit variables, and the job's CPUs reach ``srun`` explicitly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.fault_util import (
    sbatch,
    slurm_env,
)
from tests.limits import hang_limit

pytestmark = pytest.mark.slow

RECORD_SRUN = (
    'printf "%s\\n" "$@" > "$SRUN_ARGS"\necho "setup=${KFAC_SETUP_RAN:-no}" >> "$SRUN_ARGS"\n'
    'echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-}" >> "$SRUN_ARGS"\n'
)


def _requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_long_node_list_does_not_end_the_script_and_paths_and_setup_are_explicit(
    tmp_path: Path,
) -> None:
    # 200k host names: `scontrol ... | head -n 1` under pipefail died of SIGPIPE (141) here.
    hosts = 'if [ "$1 $2" = "show hostnames" ]; then seq -f "node%06g" 0 199999; fi\n'
    e = slurm_env(tmp_path, srun=RECORD_SRUN, scontrol=hosts)
    setup = tmp_path / "setup.sh"
    setup.write_text("export KFAC_SETUP_RAN=yes\n")
    e.update(SRUN_ARGS=str(tmp_path / "srun.args"), KFAC_BENCH_SETUP=str(setup), RUN_DIR="rel/dir")
    e.update(SLURM_CPUS_PER_TASK="6")
    e.pop("RDZV_PORT")  # the job's own: 29500 + 4242
    proc = sbatch(tmp_path, e, "kfac=none", cwd=tmp_path / "bin")
    _, err = proc.communicate(timeout=hang_limit(60))
    assert proc.returncode == 0, err
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert "--rdzv-endpoint=node000000:33742" in args
    # The job's CPUs, to srun explicitly (srun of Slurm 22.05-23.02 does not inherit them).
    assert "--cpus-per-task=6" in args and "SRUN_CPUS_PER_TASK=6" in args
    assert (
        "--nproc-per-node=2" in args and args[args.index("-m") + 1] == "kfac_bench.launcher.agent"
    )
    assert f"hydra.run.dir='{tmp_path}/rel/dir'" in args  # under the submit dir, not the cwd
    assert "setup=yes" in args and not _requeues(tmp_path)


def test_no_gpu_count_is_one_line(tmp_path: Path) -> None:
    e = slurm_env(tmp_path, srun=RECORD_SRUN)
    e.pop("GPUS_PER_NODE")
    e.pop("SLURM_GPUS_ON_NODE", None)
    proc = sbatch(tmp_path, e)
    _, err = proc.communicate(timeout=hang_limit(60))
    assert proc.returncode == 2
    assert err.strip().splitlines() == [
        "kfac-bench: error: no GPU count: submit with --gpus-per-node=N or set GPUS_PER_NODE"
    ]
