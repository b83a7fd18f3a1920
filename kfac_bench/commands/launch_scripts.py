"""``kfac-bench launch-scripts``: where the SLURM and multi-node torchrun scripts of ``launch/`` are, for an
install from a wheel (``pip install kfac-bench``) that has no source tree: ``cp -r "$(kfac-bench
launch-scripts)" launch`` puts them where the README's commands (``sbatch ... launch/slurm.sbatch``) expect
them."""

from __future__ import annotations

from collections.abc import Sequence

from kfac_bench.errors import ConfigError

__all__ = ["SUMMARY", "main"]

SUMMARY = """\
  launch-scripts
            print the folder of the SLURM / multi-node scripts (launch/), e.g. for a pip install:
            cp -r "$(kfac-bench launch-scripts)" launch"""


def main(args: Sequence[str]) -> int:
    """Print the folder holding ``slurm.sbatch``, ``torchrun_multinode.sh`` and ``bert_chain.sh``."""
    from kfac_bench.config import launch_dir

    if args:
        raise ConfigError(f"launch-scripts takes no arguments, got {' '.join(args)}")
    print(launch_dir())
    return 0
