"""``kfac-bench demo`` (what ``make train`` runs): both arms train as normal runs and the comparison is
written. A tiny budget through the demo's own options; no timing is asserted."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kfac_bench.commands import demo
from kfac_bench.errors import ConfigError, UserError
from tests.harness.util import run_cli


def _flat(node: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, object] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


@pytest.mark.slow
def test_demo_trains_both_arms_and_writes_the_comparison(tmp_path: Path) -> None:
    result = run_cli(
        "demo", "--seeds", "0", "--epochs", "1", "--out", "out", cwd=tmp_path, timeout=240
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    sgd = json.loads((out / "sgd_seed0" / "summary.json").read_text())
    kfac = json.loads((out / "kfac_seed0" / "summary.json").read_text())
    assert sgd["kfac_enabled"] is False and kfac["kfac_enabled"] is True
    for arm, s in (("sgd", sgd), ("kfac", kfac)):
        assert s["steps"] == 5 and s["epochs"] == 1  # 5 batches of 256 from 1437 training images
        assert len((out / f"{arm}_seed0" / "eval.jsonl").read_text().splitlines()) == 1
    # The arms differ only in K-FAC, their own learning rate, its tuning record and their name: same data,
    # seed, batch, schedule.
    a, b = _flat(sgd["config"]), _flat(kfac["config"])
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    # Each arm carries its own tuning record (arm, tuned LR); both runs are one campaign, the demo's folder.
    assert {k for k in differ if not k.startswith(("kfac.", "tuning."))} == {"name", "optimizer.lr"}
    assert a["tuning.arm"] == "sgd" and b["tuning.arm"] == "kfac"
    assert a["train.campaign"] == b["train.campaign"] == "out"
    assert a["train.seed"] == b["train.seed"] == 0 and a["train.batch_size"] == 256
    assert a["train.epochs"] == 1 and a["lr_schedule.milestones"] == b["lr_schedule.milestones"]
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["run"] for r in rows] == ["SGD", "SGD + K-FAC (COMM-OPT)"]
    assert (out / "compare.md").read_text().startswith("**target: top1 0.985 (baseline: SGD)**")
    assert (out / "compare.png").stat().st_size > 1000
    assert "verdict: SGD + K-FAC (COMM-OPT) reached top1 >= 0.985 in " in result.stdout
    assert result.stdout.strip().splitlines()[-1].endswith(f"results in {Path('out')}")
    assert (
        "sgd seed 0 and kfac seed 0 together" in result.stdout
    )  # a seed's arms share the machine's load
    assert "  seed 0: sgd " in result.stdout and "kfac/sgd epochs " in result.stdout


def test_demo_checks_its_arguments_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"train\.batchsize"):
        demo.main(["--out", "fresh", "train.batchsize=3"])
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        demo.main(["--out", "fresh", "optimizer.lr=-1"])
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "sgd_seed0").mkdir()
    with pytest.raises(UserError, match="--out used already holds"):
        demo.main(["--out", "used", "--epochs", "1"])
