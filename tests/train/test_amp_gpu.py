"""AMP on CUDA (bf16 and fp16 with a GradScaler) through the real loop, with K-FAC; skipped on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kfac_bench.train.run import train
from tests.harness.util import tiny_cfg


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_run_on_cuda(tmp_path: Path, precision: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert train(tiny_cfg("train.device=cuda", f"train.precision={precision}"), tmp_path) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] in ("success", "target_not_reached") and s["kfac_enabled"]
    assert s["peak_memory_bytes"]["device_max_allocated"] > 0 and "cuda" not in s["device"]


def test_precision_is_ignored_on_cpu(tmp_path: Path) -> None:
    assert train(tiny_cfg("train.device=cpu", "train.precision=fp16", "kfac=none"), tmp_path) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["device"] == "cpu" and s["status"] in ("success", "target_not_reached")
