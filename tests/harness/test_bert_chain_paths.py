"""launch/bert_chain.sh with a hostile CHAIN_DIR: sbatch's ``--export=ALL,RUN_DIR=...`` splits its value at
every ``,``, so such a folder is refused with one line before anything is submitted; other characters pass
through as one variable."""

from __future__ import annotations

from pathlib import Path

from tests.harness.test_bert_chain import _chain, _options


def test_a_chain_dir_with_a_comma_is_refused_before_submitting(tmp_path: Path) -> None:
    result, calls = _chain(tmp_path, "lamb", "kfac", CHAIN_DIR="runs/a,GPUS_PER_NODE=64")
    assert result.returncode == 2 and calls == []
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "kfac-bench: error: CHAIN_DIR 'runs/a,GPUS_PER_NODE=64'"
    )
    assert "','" in lines[0]


def test_a_chain_dir_with_spaces_and_equals_is_one_variable(tmp_path: Path) -> None:
    result, calls = _chain(tmp_path, "lamb", "kfac", CHAIN_DIR="runs/x y=z")
    assert result.returncode == 0, result.stderr
    exports = [_options(c)[0]["export"] for c in calls]
    assert exports[0] == "ALL,RUN_DIR=runs/x y=z/phase1"
    assert exports[2] == "ALL,RUN_DIR=runs/x y=z/squad,GPUS_PER_NODE=1"
