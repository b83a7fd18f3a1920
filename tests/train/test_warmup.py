"""The untimed warm-up step before the clock starts is undone: a run trains bit-identically with it and
without it (weights, optimizer and K-FAC state, random generators), and its stage times leave it out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kfac_bench.checkpoint.manager import CHECKPOINT_DIR, CheckpointManager
from kfac_bench.train import run as run_module
from kfac_bench.train.run import train
from tests.harness.util import tiny_cfg

#: A K-FAC decomposition every 4 steps: a warm-up step left in the K-FAC state would shift them.
COMMON = ("train.checkpoint_every_epochs=0", "kfac.inv_update_steps=4")


def _run(tmp: Path, *overrides: str) -> tuple[dict, dict]:
    assert train(tiny_cfg(*COMMON, *overrides), tmp) == 0
    saved = CheckpointManager(tmp / CHECKPOINT_DIR, {}).read()
    assert saved is not None
    return json.loads((tmp / "summary.json").read_text()), saved


@pytest.mark.parametrize("kfac", ["none", "comm_opt"])
def test_the_warm_up_step_leaves_no_trace_in_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kfac: str
) -> None:
    calls: list[bool] = []
    real = run_module.warm_up

    def counted(loop: object, stages: object = None) -> bool:
        calls.append(real(loop, stages))  # type: ignore[arg-type]
        return calls[-1]

    monkeypatch.setattr(run_module, "warm_up", counted)
    warm, warm_saved = _run(tmp_path / "warm", f"kfac={kfac}")
    assert calls == [True]
    monkeypatch.setattr(run_module, "warm_up", lambda loop, stages=None: False)
    cold, cold_saved = _run(tmp_path / "cold", f"kfac={kfac}")
    assert warm["final_metrics"] == cold["final_metrics"] and warm["steps"] == cold["steps"]
    for part in ("model", "optimizer", "rng"):
        flat_warm, flat_cold = _tensors(warm_saved[part]), _tensors(cold_saved[part])
        assert flat_warm.keys() == flat_cold.keys(), part
        for key, value in flat_warm.items():
            assert torch.equal(value, flat_cold[key]), (part, key)
    if kfac != "none":
        w, c = _tensors(warm_saved["precond"]), _tensors(cold_saved["precond"])
        assert w.keys() == c.keys() and all(torch.equal(w[k], c[k]) for k in w)
        assert warm_saved["precond"]["steps"] == cold_saved["precond"]["steps"]
        # Stage seconds: the warm-up's are taken off, never negative.
        assert all(v >= 0 for v in warm["kfac_stage_times_s"].values())


def _tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}.{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}[{i}]"))
    return out
