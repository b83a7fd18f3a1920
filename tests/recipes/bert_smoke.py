"""BERT smoke runs through the CLI, and the phase-1 smoke runs shared by the pretraining tests
(test_bert_recipes.py) and the SQuAD chain (test_bert_squad_recipe.py): both start from the same two runs,
one per arm, on one prepared shard folder.

``make test`` may hand the two files to different xdist workers. The first worker to ask runs the two
phase-1 runs in a folder both workers see (the parent of pytest's per-worker temporary folders), under a
file lock; the other waits on the lock and reads what the first left. Nothing reads the runs but the
tests, which only read them (later phases write their own run folders).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from tests.harness.util import run_cli

#: Options every smoke run in these tests takes: no TensorBoard files, a progress line per evaluation.
CLI_QUIET = ["train.tensorboard=false", "train.progress=lines"]
#: The phase-1 smoke recipe of each arm (TPDS Table 4: the LAMB baseline, K-FAC).
PHASE1 = {
    "lamb": "bert_large_pretrain_phase1_lamb_smoke",
    "kfac": "bert_large_pretrain_phase1_smoke",
}


def train_smoke(root: Path, name: str, recipe: str, *overrides: str) -> Path:
    """``kfac-bench train +recipe=RECIPE OVERRIDES`` into ``root/name``, which it returns; fails the test
    with the run's stderr if it fails."""
    result = run_cli(
        "train",
        f"+recipe={recipe}",
        *overrides,
        *CLI_QUIET,
        f"hydra.run.dir={root / name}",
        cwd=root,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (root / name / "stdout.txt").write_text(result.stdout)
    return root / name


@pytest.fixture(scope="session")
def bert_phase1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"lamb": run, "kfac": run, "shards128": folder}``: both arms' phase-1 smoke runs, once per test
    run, reading the shards the first of them prepares (``dataset.root``)."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is .../popen-gwN, whose parent the workers share.
    shared = base.parent if base.name.startswith("popen-gw") else base
    root = shared / "bert_phase1"
    with FileLock(str(shared / "bert_phase1.lock")):
        done = root / "done.json"
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)  # what a failed attempt left: not to be resumed
            root.mkdir()
            for arm, recipe in PHASE1.items():
                train_smoke(root, arm, recipe, f"dataset.root={root / 'shards128'}")
            done.write_text(json.dumps(sorted(PHASE1)))
    return {**{arm: root / arm for arm in PHASE1}, "shards128": root / "shards128"}
