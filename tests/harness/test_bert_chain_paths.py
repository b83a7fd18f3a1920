"""launch/bert_chain.sh with a hostile CHAIN_DIR: sbatch's ``--export=ALL,RUN_DIR=...`` splits its value at
every ``,``, so such a folder is refused with one line before anything is submitted (as are a quote, a
backslash and ``${``, which the Hydra-quoted checkpoint paths cannot hold); spaces, ``=`` and non-ASCII pass
through as one variable and one checkpoint path."""

from __future__ import annotations

from pathlib import Path

import pytest

from kfac_bench.config.compose import compose_run
from tests.harness.test_bert_chain import _chain, _options


def test_a_chain_dir_with_a_comma_is_refused_before_submitting(tmp_path: Path) -> None:
    result, calls = _chain(tmp_path, "lamb", "kfac", CHAIN_DIR="runs/a,GPUS_PER_NODE=64")
    assert result.returncode == 2 and calls == []
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "kfac-bench: error: CHAIN_DIR 'runs/a,GPUS_PER_NODE=64'"
    )
    assert "','" in lines[0]


@pytest.mark.parametrize("chain_dir", ["runs/a'b", "runs/a\\b", "runs/a${x}"])
def test_a_chain_dir_hydra_quoting_cannot_hold_is_refused(tmp_path: Path, chain_dir: str) -> None:
    result, calls = _chain(tmp_path, "lamb", "kfac", CHAIN_DIR=chain_dir)
    assert result.returncode == 2 and calls == []
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kfac-bench: error: CHAIN_DIR '{chain_dir}'")


def test_a_chain_dir_with_spaces_equals_and_non_ascii_is_one_variable_and_one_path(
    tmp_path: Path,
) -> None:
    result, calls = _chain(tmp_path, "lamb", "kfac", CHAIN_DIR="runs/x y=ü")
    assert result.returncode == 0, result.stderr
    options = [_options(c) for c in calls]
    assert options[0][0]["export"] == "ALL,RUN_DIR=runs/x y=ü/phase1"
    assert options[2][0]["export"] == "ALL,RUN_DIR=runs/x y=ü/squad,GPUS_PER_NODE=1"
    # What phase 2 and SQuAD hand to `kfac-bench train` composes to the previous stage's checkpoint.
    assert (
        compose_run(options[1][1]).model.init_checkpoint == "runs/x y=ü/phase1/checkpoints/last.pt"
    )
    assert (
        compose_run(options[2][1]).model.init_checkpoint == "runs/x y=ü/phase2/checkpoints/last.pt"
    )
