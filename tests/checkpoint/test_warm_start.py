"""``train.init_from`` (BERT phase 2 from phase 1): what a run carries over from another run's checkpoint and
what it starts afresh, checked against the phase-1 checkpoint file itself, and one-line errors for a
checkpoint of the wrong kind.

Phase 1 and phase 2 are tiny digits runs with LAMB (the BERT recipes' optimizer); phase 2 changes the LR,
warm-up and length, as the BERT phases do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.checkpoint.warm_start import locate, start_from
from kfac_bench.errors import ConfigError
from kfac_bench.launcher.distributed import DistEnv
from kfac_bench.train.build import build_run
from kfac_bench.train.run import train
from tests.harness.util import run_cli, tiny_cfg

LAMB = ("optimizer=lamb", "optimizer.lr=0.01", "kfac.inv_update_steps=2")
PHASE2 = ("optimizer.lr=0.004", "lr_schedule.warmup=1", "train.epochs=1")


def _env() -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=1)


@pytest.fixture(scope="module")
def phase1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Finished phase-1 runs: LAMB + K-FAC, the same without K-FAC on the first convolution, LAMB alone,
    SGD + K-FAC."""
    root = tmp_path_factory.mktemp("phase1")
    runs = {
        "kfac": (*LAMB, "kfac=comm_opt"),
        "kfac_skip": (*LAMB, "kfac=comm_opt", r"kfac.skip_layers=['^features\.0$']"),
        "lamb": (*LAMB, "kfac=none"),
        "sgd": ("kfac=comm_opt", "kfac.inv_update_steps=2"),
    }
    for name, overrides in runs.items():
        assert train(tiny_cfg(*overrides, "train.epochs=1"), root / name) == 0
    return {name: root / name for name in runs}


def _saved(run: Path) -> dict:
    saved = CheckpointManager(run / CHECKPOINT_DIR, {}).read()
    assert saved is not None
    return saved


def _phase2(tmp: Path, *overrides: str):  # type: ignore[no-untyped-def]
    cfg = tiny_cfg(*LAMB, *PHASE2, *overrides)
    return cfg, build_run(cfg, tmp, _env(), torch.device("cpu"))


def test_model_moments_and_factors_carried_counters_and_schedule_reset(
    phase1: dict[str, Path], tmp_path: Path
) -> None:
    saved = _saved(phase1["kfac"])
    assert saved["step"] == 6 and saved["precond"]["steps"] == 6
    cfg, run = _phase2(tmp_path, "kfac=comm_opt")
    loop = run.loop
    line = start_from(str(phase1["kfac"]), loop.module, loop.optimizer, loop.precond)
    assert "K-FAC factors of 4/4 layers" in line and "step 6" in line
    # The model: every weight of phase 1.
    for key, value in loop.module.state_dict().items():
        assert torch.equal(value, saved["model"][key]), key
    # LAMB's moments carried, parameter by parameter, in the optimizer's order.
    params = [p for g in loop.optimizer.param_groups for p in g["params"]]
    assert len(params) == len(saved["optimizer"]["state"])
    for i, p in enumerate(params):
        state = loop.optimizer.state[p]
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[moment], saved["optimizer"]["state"][i][moment])
    # Phase 2's hyperparameters and a fresh step counter (LAMB's bias correction starts again); the LR
    # schedule at its step 0 (LR x warm-up start 1/world = 1).
    for group, old in zip(loop.optimizer.param_groups, saved["optimizer"]["param_groups"]):
        assert old["step"] == 6 and "step" not in group
        assert group["initial_lr"] == pytest.approx(0.004) and old["initial_lr"] == pytest.approx(
            0.01
        )
        assert group["lr"] == pytest.approx(0.004 * 1.0)
        assert group["weight_decay"] in (0.0, pytest.approx(cfg.optimizer.weight_decay))
    assert run.loop.scheduler.last_epoch == 0 and loop.state.step == 0 and loop.state.samples == 0
    # K-FAC: phase 1's running factors, step counter 0, decompositions left to the first step.
    kfac_state = loop.precond.state_dict(include_decompositions=True)
    assert kfac_state["steps"] == 0
    for name, entry in kfac_state["layers"].items():
        old = saved["precond"]["layers"][name]
        assert torch.equal(entry["a_factor"], old["a_factor"]), name
        assert torch.equal(entry["g_factor"], old["g_factor"]), name
        assert entry["decompositions"] is None
    # One step later LAMB has stepped once (bias correction of step 1), K-FAC decomposed at its step 0.
    assert train(tiny_cfg(*LAMB, *PHASE2, "kfac=comm_opt", f"train.init_from={phase1['kfac']}",
                          "train.max_steps=1"), tmp_path / "run") == 0  # fmt: skip
    after = _saved(tmp_path / "run")
    assert after["precond"]["steps"] == 1 and after["train_state"]["step"] == 1
    assert all(int(g["step"]) == 1 for g in after["optimizer"]["param_groups"])


def test_phase1_without_kfac_starts_the_factors_from_the_identity(
    phase1: dict[str, Path], tmp_path: Path
) -> None:
    _, run = _phase2(tmp_path, "kfac=comm_opt")
    line = start_from(phase1["lamb"], run.loop.module, run.loop.optimizer, run.loop.precond)
    assert "from the identity (phase 1 ran without K-FAC)" in line
    state = run.loop.precond.state_dict()
    assert state["steps"] == 0
    assert all(e["a_factor"] is None and e["g_factor"] is None for e in state["layers"].values())


def test_phase2_without_kfac_ignores_the_factors(phase1: dict[str, Path], tmp_path: Path) -> None:
    _, run = _phase2(tmp_path, "kfac=none")
    line = start_from(phase1["kfac"], run.loop.module, run.loop.optimizer, None)
    assert "no K-FAC (phase 1's factors unused)" in line


def test_a_different_kfac_layer_set_carries_the_common_layers(
    phase1: dict[str, Path], tmp_path: Path
) -> None:
    # Phase 2 skips a layer that phase 1 preconditioned: the others are carried.
    _, run = _phase2(tmp_path / "a", "kfac=comm_opt", r"kfac.skip_layers=['^classifier\.3$']")
    line = start_from(phase1["kfac"], run.loop.module, run.loop.optimizer, run.loop.precond)
    assert "K-FAC factors of 3/3 layers;" in line
    # Phase 2 preconditions a layer that phase 1 skipped: it starts from the identity.
    _, run = _phase2(tmp_path / "b", "kfac=comm_opt")
    line = start_from(phase1["kfac_skip"], run.loop.module, run.loop.optimizer, run.loop.precond)
    assert (
        "K-FAC factors of 3/4 layers (the others from the identity; 1 not among phase 1's" in line
    )
    layers = run.loop.precond.state_dict()["layers"]
    assert layers["features.0"]["a_factor"] is None and layers["features.2"]["a_factor"] is not None


@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        ("sgd", (), "holds the state of another optimizer"),
        ("kfac", ("model.channels=16",), "holds another model's weights"),
        ("kfac", ("optimizer.no_decay_bias_and_norm=false",), "parameter groups of sizes"),
    ],
)
def test_a_checkpoint_of_the_wrong_kind_is_one_line(
    phase1: dict[str, Path], tmp_path: Path, source: str, overrides: tuple[str, ...], message: str
) -> None:
    _, run = _phase2(tmp_path, "kfac=comm_opt", *overrides)
    with pytest.raises(ConfigError, match=message) as err:
        start_from(phase1[source], run.loop.module, run.loop.optimizer, run.loop.precond)
    assert "\n" not in str(err.value) and str(phase1[source]) in str(err.value)


def test_paths_that_hold_no_training_checkpoint(phase1: dict[str, Path], tmp_path: Path) -> None:
    _, run = _phase2(tmp_path / "run", "kfac=none")
    parts = (run.loop.module, run.loop.optimizer, None)
    assert locate(phase1["kfac"]) == locate(phase1["kfac"] / CHECKPOINT_DIR)
    assert locate(phase1["kfac"] / CHECKPOINT_DIR / "last.pt") == phase1["kfac"] / CHECKPOINT_DIR
    with pytest.raises(ConfigError, match="does not exist"):
        start_from(tmp_path / "nope", *parts)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint in"):
        start_from(tmp_path / "empty", *parts)
    weights = tmp_path / "weights" / CHECKPOINT_DIR
    weights.mkdir(parents=True)
    torch.save(run.loop.module.state_dict(), weights / "last.pt")
    with pytest.raises(
        ConfigError, match=r"not a kfac-bench training checkpoint.*model\.init_checkpoint"
    ):
        start_from(weights.parent, *parts)
    (weights / "last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        start_from(weights / "last.pt", *parts)


@pytest.mark.slow
def test_cli_stops_with_one_line(phase1: dict[str, Path], tmp_path: Path) -> None:
    done = run_cli(
        "train",
        "+recipe=digits_smoke",
        "optimizer=lamb",
        f"train.init_from={phase1['sgd']}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kfac-bench: error: train.init_from: ")
    assert "another optimizer" in err[0]
