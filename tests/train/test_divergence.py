"""Non-finite state is never checkpointed or resumed: a diverging run (a huge LR, or a NaN gradient behind a
finite loss) keeps its last finite checkpoint, records ``diverged``, and the same command run again stops
with one line; every JSON file the run writes parses with a strict parser (NaN is written as null)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kfac_bench.checkpoint import files
from kfac_bench.checkpoint.manager import CheckpointManager, NonFiniteState
from kfac_bench.errors import UserError
from kfac_bench.metrics.sinks import JsonlSink
from kfac_bench.metrics.summary import write_summary
from kfac_bench.models.small_cnn import SmallCNN
from kfac_bench.train.run import train
from kfac_bench.train.warmup import warming_up
from tests.harness.fault_util import one_error_line
from tests.harness.util import TINY, run_cli, tiny_cfg


class NaNGradOnce(SmallCNN):
    """SmallCNN whose ``at``-th training forward makes every gradient NaN (the loss stays finite)."""

    def __init__(self, at: int, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training and not warming_up():  # the untimed warm-up step is not a step of the run
            self.calls += 1
            if self.calls == self.at:
                out.register_hook(lambda g: torch.full_like(g, float("nan")))
        return out


def build_nan_grad_once(at: int, **sizes: int) -> NaNGradOnce:
    return NaNGradOnce(at, **sizes)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict(text: str) -> Any:
    """A strict JSON parse: NaN, Infinity and -Infinity are refused (as jq or JavaScript would)."""
    obj = json.loads(text, parse_constant=_no_constants)
    json.dumps(obj, allow_nan=False)
    return obj


def _all_finite(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_all_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_all_finite(v) for v in state)
    return True


def _checkpoints(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {
        int(p.stem.split("-")[1]): torch.load(p, weights_only=True)
        for p in sorted((run_dir / "checkpoints").glob("step-*.pt"))
    }


#: mlperf.log is written on request for digits (it is no MLPerf benchmark): its lines must be strict JSON too.
HUGE_LR = (
    "optimizer.lr=1e6",
    "train.checkpoint_every_steps=2",
    "train.eval_every_steps=2",
    "train.mlperf_log=true",
)
NAN_GRAD = (
    "model._target_=tests.train.test_divergence.build_nan_grad_once",
    "+model.at=3",
    "train.checkpoint_every_steps=1",
)


@pytest.fixture(scope="module")
def huge_lr(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("huge_lr")
    assert train(tiny_cfg(*HUGE_LR), run_dir) == 0  # diverged is a result, not a crash
    return run_dir


def test_a_diverged_run_keeps_only_finite_checkpoints(huge_lr: Path) -> None:
    saved = _checkpoints(huge_lr)
    assert saved, "the run checkpointed before it diverged"
    for step, payload in saved.items():
        for part in ("model", "optimizer", "precond"):
            assert _all_finite(payload[part]), f"step {step}: non-finite {part}"
    summary = strict((huge_lr / "summary.json").read_text())
    assert summary["status"] == "diverged"
    assert summary["divergence"]["step"] > max(saved)
    marker = (huge_lr / "diverged").read_text()
    assert f"step {summary['divergence']['step']}" in marker
    assert f"step-{max(saved):08d}.pt" in marker  # the last finite checkpoint


def test_json_outputs_of_a_diverged_run_are_strict_json(huge_lr: Path) -> None:
    records = [strict(line) for line in (huge_lr / "eval.jsonl").read_text().splitlines()]
    assert any(r["metrics"]["loss"] is None for r in records)  # the NaN loss, written as null
    for line in (huge_lr / "mlperf.log").read_text().splitlines():
        strict(line.split(":::MLLOG ", 1)[1])


@pytest.mark.slow
def test_the_same_command_refuses_to_resume_a_diverged_run(huge_lr: Path) -> None:
    before = sorted(p.name for p in (huge_lr / "checkpoints").iterdir())
    step = strict((huge_lr / "summary.json").read_text())["divergence"]["step"]
    result = run_cli("train", *TINY, *HUGE_LR, f"hydra.run.dir={huge_lr}", cwd=huge_lr.parent)
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "diverged" in line and f"step {step}" in line and "optimizer.lr" in line
    assert sorted(p.name for p in (huge_lr / "checkpoints").iterdir()) == before


def test_a_nan_gradient_behind_a_finite_loss_is_never_saved(tmp_path: Path) -> None:
    assert train(tiny_cfg(*NAN_GRAD), tmp_path) == 0
    saved = _checkpoints(tmp_path)
    assert sorted(saved) == [1, 2]  # step 3's weights are NaN: no checkpoint; keep=2 kept 1 and 2
    assert all(_all_finite(p[k]) for p in saved.values() for k in ("model", "optimizer", "precond"))
    summary = strict((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["divergence"]["step"] == 3
    with pytest.raises(UserError, match="diverged") as info:
        train(tiny_cfg(*NAN_GRAD), tmp_path)
    assert "\n" not in str(info.value)
    # train.resume=false starts the run over (it diverges at the same step again).
    (tmp_path / "summary.json").unlink()
    assert train(tiny_cfg(*NAN_GRAD, "train.resume=false"), tmp_path) == 0
    assert strict((tmp_path / "summary.json").read_text())["divergence"]["step"] == 3


def test_a_non_finite_save_writes_nothing_and_rotates_nothing(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    manager = CheckpointManager(tmp_path, {"model": model}, keep=1)
    manager.save(1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with torch.no_grad():
        model.bias[0] = math.inf
    with pytest.raises(NonFiniteState, match=r"model: 1/8 values non-finite \(first: bias\)"):
        manager.save(2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


class Factors:
    """A stand-in preconditioner part: K-FAC factors."""

    def __init__(self, a: torch.Tensor) -> None:
        self.a = a

    def state_dict(self) -> dict[str, Any]:
        return {"steps": 3, "layers": {"fc": {"a_factor": self.a}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.a = state["layers"]["fc"]["a_factor"]


def test_a_non_finite_preconditioner_is_not_saved(tmp_path: Path) -> None:
    parts = {"model": torch.nn.Linear(2, 2), "precond": Factors(torch.tensor([[1.0, math.nan]]))}
    with pytest.raises(NonFiniteState, match="precond: 1/2"):
        CheckpointManager(tmp_path, parts).save(5)
    assert not list(tmp_path.glob("step-*"))


def test_a_non_finite_checkpoint_of_an_older_run_is_not_resumed(tmp_path: Path) -> None:
    # Written without the check (as the previous code did): resuming it stops with one line.
    model = torch.nn.Linear(3, 2)
    files.write_checkpoint(
        tmp_path, {"model": {"weight": torch.full((2, 3), math.nan)}, "step": 4}, 4, 2
    )
    with pytest.raises(UserError, match="non-finite") as info:
        CheckpointManager(tmp_path, {"model": model}).load()
    assert "step 4" in str(info.value) and "\n" not in str(info.value)


def test_summary_and_eval_records_write_non_finite_numbers_as_null(tmp_path: Path) -> None:
    values = {"loss": math.nan, "up": math.inf, "down": -math.inf, "ok": 1.5, "nested": [math.nan]}
    write_summary(tmp_path, {"final_metrics": values})
    JsonlSink(tmp_path / "eval.jsonl").write({"step": 1, "metrics": values})
    expected = {"loss": None, "up": None, "down": None, "ok": 1.5, "nested": [None]}
    assert strict((tmp_path / "summary.json").read_text())["final_metrics"] == expected
    assert strict((tmp_path / "eval.jsonl").read_text())["metrics"] == expected
