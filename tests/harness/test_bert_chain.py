"""launch/bert_chain.sh: three sbatch jobs chained by afterok, each a launch/slurm.sbatch job whose overrides
compose, phase 2 and SQuAD starting from the previous job's fixed checkpoint path. A fake ``sbatch`` on PATH
records the calls (bash -n and shellcheck run on every launch/ script in test_launch.py)."""

from __future__ import annotations

import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from kfac_bench.config.compose import compose_run
from tests.harness.util import REPO, cli_env
from tests.limits import hang_limit

pytestmark = pytest.mark.slow

SCRIPT = REPO / "launch" / "bert_chain.sh"

# Prints job ids 100, 101, ... as `sbatch --parsable` does on a federated cluster ("id;cluster"), after
# recording its arguments one call per line.
FAKE_SBATCH = """#!/usr/bin/env bash
n=$(( $(wc -l < "$SBATCH_LOG") + 100 ))
printf '%q ' "$@" >> "$SBATCH_LOG"
printf '\\n' >> "$SBATCH_LOG"
echo "$n;cluster"
"""


def _chain(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(FAKE_SBATCH)
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "sbatch.log"
    log.write_text("")
    environment = cli_env()
    environment.update(PATH=f"{bin_dir}:{environment['PATH']}", SBATCH_LOG=str(log), **env)
    result = subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=hang_limit(60),
    )
    return result, [shlex.split(line) for line in log.read_text().splitlines()]


def _options(call: list[str]) -> tuple[dict[str, str], list[str]]:
    """(sbatch options before the script, the overrides after launch/slurm.sbatch)."""
    at = call.index("launch/slurm.sbatch")
    options = dict(o.removeprefix("--").split("=", 1) for o in call[:at] if "=" in o)
    return options, call[at + 1 :]


@pytest.mark.parametrize(
    ("arms", "recipes"),
    [
        (("lamb", "lamb"), ("bert_large_pretrain_phase1_lamb", "bert_large_pretrain_phase2_lamb")),
        (("lamb", "kfac"), ("bert_large_pretrain_phase1_lamb", "bert_large_pretrain_phase2")),
        (("kfac", "lamb"), ("bert_large_pretrain_phase1", "bert_large_pretrain_phase2_lamb")),
        (("kfac", "kfac"), ("bert_large_pretrain_phase1", "bert_large_pretrain_phase2")),
    ],
)
def test_chain_submits_three_dependent_jobs(
    tmp_path: Path, arms: tuple[str, str], recipes: tuple[str, str]
) -> None:
    result, calls = _chain(tmp_path, *arms)
    assert result.returncode == 0, result.stderr
    assert len(calls) == 3 and all("--parsable" in c for c in calls)
    (o1, a1), (o2, a2), (o3, a3) = (_options(c) for c in calls)
    folder = f"runs/bert-chain-{arms[0]}-{arms[1]}"
    # Each job waits for the one before, by the id sbatch printed (without the cluster name).
    assert "dependency" not in o1
    assert o2["dependency"] == "afterok:100" and o3["dependency"] == "afterok:101"
    assert [o["export"].split(",")[1] for o in (o1, o2, o3)] == [
        f"RUN_DIR={folder}/phase1",
        f"RUN_DIR={folder}/phase2",
        f"RUN_DIR={folder}/squad",
    ]
    assert o1["nodes"] == o2["nodes"] == "2" and o3["nodes"] == "1"  # 16 A100; SQuAD on one GPU
    assert "GPUS_PER_NODE=1" in o3["export"] and o3["gpus-per-node"] == "1"
    assert a1 == [f"+recipe={recipes[0]}"]
    assert a2 == [
        f"+recipe={recipes[1]}",
        f"model.init_checkpoint='{folder}/phase1/checkpoints/last.pt'",
    ]
    assert a3 == [
        "+recipe=bert_large_squad",
        f"model.init_checkpoint='{folder}/phase2/checkpoints/last.pt'",
    ]
    # What each job hands to `kfac-bench train` composes, and K-FAC is on exactly where the arm says.
    kfac = [compose_run(args).kfac.enabled for args in (a1, a2, a3)]
    assert kfac == [arms[0] == "kfac", arms[1] == "kfac", False]
    assert (
        f"--chain {arms[0]}-{arms[1]}={folder}/phase1,{folder}/phase2,{folder}/squad"
        in result.stdout
    )


def test_chain_passes_extra_overrides_per_stage(tmp_path: Path) -> None:
    result, calls = _chain(
        tmp_path,
        "kfac",
        "lamb",
        CHAIN_DIR="runs/t4b",
        P1_ARGS="train.max_steps=6000 train.seed=3",
        P2_ARGS="train.max_steps=1200",
        SQUAD_ARGS="dataset.train_file=/data/train-v1.1.json train.epochs=3",
        NODES="4",
        SQUAD_GPUS="2",
    )
    assert result.returncode == 0, result.stderr
    (o1, a1), (o2, a2), (o3, a3) = (_options(c) for c in calls)
    assert a1[1:] == ["train.max_steps=6000", "train.seed=3"] and a2[2:] == ["train.max_steps=1200"]
    assert a3[2:] == ["dataset.train_file=/data/train-v1.1.json", "train.epochs=3"]
    assert o1["nodes"] == o2["nodes"] == "4" and o3["gpus-per-node"] == "2"
    assert o3["export"] == "ALL,RUN_DIR=runs/t4b/squad,GPUS_PER_NODE=2"
    assert compose_run(a1).train.max_steps == 6000 and compose_run(a3).train.epochs == 3


@pytest.mark.parametrize("args", [(), ("lamb",), ("adam", "lamb"), ("lamb", "kfac", "x")])
def test_bad_arms_stop_before_submitting(tmp_path: Path, args: tuple[str, ...]) -> None:
    result, calls = _chain(tmp_path, *args)
    assert result.returncode == 2 and calls == []
    assert result.stderr.strip().startswith("usage: launch/bert_chain.sh lamb|kfac lamb|kfac")
