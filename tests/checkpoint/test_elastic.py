"""Elastic resume in-process: the sampler continues an epoch at a global example position on any number of
ranks (every optimizer step gets the same examples as on the starting world), the accumulation that keeps
the global batch or a one-line refusal, and where the starting world is read from."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from kfac_bench.checkpoint.elastic import (
    World,
    accumulation_for,
    check_kfac_world,
    read_world,
    record_world,
    starting_world,
)
from kfac_bench.data.base import DataSplits
from kfac_bench.data.loader import build_loaders
from kfac_bench.errors import ConfigError


def _steps(
    n: int, world: int, batch: int, accumulation: int, epoch: int, start: int, steps: int
) -> list[Counter[int]]:
    """The dataset indices of each of ``steps`` optimizer steps from position ``start`` of ``epoch``,
    over ``world`` ranks."""
    splits = DataSplits(TensorDataset(torch.arange(n)), TensorDataset(torch.arange(3)))
    per_rank = []
    for rank in range(world):
        train, _, sampler = build_loaders(splits, batch, world, rank, seed=5)
        sampler.cover(
            n + 7
        )  # padding beyond this world's own, as a plan made on another world can ask
        sampler.set_epoch(epoch, start=start)
        batches = [b[0].tolist() for b in itertools.islice(iter(train), steps * accumulation)]
        per_rank.append(batches)
    return [
        Counter(
            i
            for rank in per_rank
            for micro in rank[s * accumulation : (s + 1) * accumulation]
            for i in micro
        )
        for s in range(steps)
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_an_epoch_continued_on_any_world_size_gives_every_step_the_same_examples(
    world: int,
) -> None:
    # 21 examples, global batch 8 = 2 per micro-batch x 2 ranks x 2: the third step reaches into the
    # padding (examples repeated by wrapping around, as DistributedSampler pads), on every world size.
    whole = _steps(21, world=2, batch=2, accumulation=2, epoch=3, start=0, steps=3)
    assert sum(sum(c.values()) for c in whole) == 24
    before = _steps(21, world=2, batch=2, accumulation=2, epoch=3, start=0, steps=1)
    after = _steps(21, world, batch=2, accumulation=8 // (2 * world), epoch=3, start=8, steps=2)
    assert before + after == whole


def test_the_global_batch_is_kept_by_accumulation_or_refused_in_one_line() -> None:
    world = World(world_size=2, global_batch=128, batch_size=32)
    assert [accumulation_for(world, n) for n in (1, 2, 4)] == [4, 2, 1]
    for n in (3, 8):
        with pytest.raises(ConfigError) as err:
            accumulation_for(world, n)
        assert "\n" not in str(err.value)
        assert f"which {n} ranks cannot keep" in str(err.value)
        assert "resume on 1, 2 or 4 ranks" in str(err.value)


def test_the_starting_world_is_the_recorded_one_only_when_a_checkpoint_will_be_resumed(
    tmp_path: Path,
) -> None:
    world = World(world_size=2, global_batch=128, batch_size=32)
    record_world(tmp_path, world)
    assert read_world(tmp_path) == world
    assert starting_world(tmp_path, resume=True, world_size=4) == 4  # no checkpoint: a fresh start
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"x")
    assert starting_world(tmp_path, resume=True, world_size=4) == 2
    assert starting_world(tmp_path, resume=False, world_size=4) == 4
    (tmp_path / "world.json").write_text("{not json")
    assert read_world(tmp_path) is None
    assert starting_world(tmp_path, resume=True, world_size=4) == 4


def test_a_grad_worker_fraction_that_cannot_place_on_the_new_world_is_one_line() -> None:
    cfg = OmegaConf.create({"kfac": {"enabled": True, "grad_worker_fraction": "0.5"}})
    for world in (1, 2, 4):
        check_kfac_world(cfg, world)  # 1, 1 and 2 gradient workers per layer
    with pytest.raises(
        ConfigError, match=r"^kfac\.grad_worker_fraction=0\.5 gives 2 .* world size 3"
    ):
        check_kfac_world(cfg, 3)
    check_kfac_world(
        OmegaConf.create({"kfac": {"enabled": False, "grad_worker_fraction": "0.5"}}), 3
    )


def test_the_multinode_agent_refuses_a_world_that_cannot_keep_the_global_batch_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kfac_bench.launcher import rundir
    from kfac_bench.launcher.agent import main, torchrun_world_size
    from tests.harness.util import TINY, tiny_cfg

    assert (
        torchrun_world_size(["--nnodes=2", "--nproc_per_node", "4", "-m", "x", "--nnodes=9"]) == 8
    )
    assert torchrun_world_size(["--nnodes=1:4", "--nproc-per-node=2"]) is None
    assert torchrun_world_size(["--standalone", "--nproc-per-node=3"]) == 3
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(
        b"x"
    )  # a checkpoint to resume (never read here)
    record_world(run_dir, World(world_size=2, global_batch=64, batch_size=32))
    rundir.record_config(run_dir, tiny_cfg())  # the run's own config: only the world differs
    command = ["-m", "kfac_bench.cli", "train", *TINY, f"hydra.run.dir={run_dir}"]
    assert main(["--nnodes=1", "--nproc-per-node=4", *command]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "which 4 ranks cannot keep" in lines[0], lines
    assert "resume on 1 or 2 ranks" in lines[0]


def test_a_refusal_every_node_finds_alike_is_printed_once_per_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-rank run resumed on 2 nodes x 2 ranks under SLURM: srun starts the agent on each node, and both
    outputs go into the job's one file. Each agent stops with status 2; the line is there once."""
    from kfac_bench.launcher import rundir
    from kfac_bench.launcher.agent import main
    from tests.harness.util import TINY, tiny_cfg

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"x")
    record_world(run_dir, World(world_size=2, global_batch=64, batch_size=32))
    rundir.record_config(run_dir, tiny_cfg())
    command = ["-m", "kfac_bench.cli", "train", *TINY, f"hydra.run.dir={run_dir}"]
    printed = []
    for task in ("0", "1"):
        monkeypatch.setenv("SLURM_PROCID", task)
        assert main(["--nnodes=2", "--nproc-per-node=2", *command]) == 2
        printed += capsys.readouterr().err.strip().splitlines()
    assert len(printed) == 1 and "which 4 ranks cannot keep" in printed[0], printed
    # A node's own device problem is still reported by every node.
    for task in ("0", "1"):
        monkeypatch.setenv("SLURM_PROCID", task)
        assert main(["--nnodes=2", "--nproc-per-node=2", *command, "train.device=cuda"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "cuda" in line.lower()
