"""Every sweep the docs show runs, in miniature, and pits a tuned first-order baseline (its own ``_sgd`` /
``_lamb`` recipe, with its tuning record) against K-FAC: never ``kfac=none`` on the K-FAC recipe, which
would run the baseline at K-FAC's learning rate."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from kfac_bench.commands import train as train_command
from kfac_bench.compare.fairness import run_flags

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    ROOT / "recipes" / "README.md",
    *sorted((ROOT / "configs" / "hydra" / "launcher").glob("*.yaml")),
    # docs/own_model.md's sweep is over a user's own recipes: tests/harness/test_own_model.py runs it.
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "own_model.md"),
]
_SWEEP = re.compile(r"kfac-bench train (?:-m|--multirun)\b")
#: What each recipe family needs to run in a second on this machine (its real data is not here).
MINIATURE: dict[str, list[str]] = {
    "digits": [],
    "resnet32_cifar10": [
        "dataset=cifar10_tiny",
        "train.batch_size=16",
        "train.eval_batch_size=16",
        "train.num_workers=0",
    ],
}
COMMON = [
    "train.epochs=1",
    "train.limit_train_batches=1",
    "train.limit_eval_batches=1",
    "train.progress=none",
    "train.tensorboard=false",
    "train.device=cpu",
    "train.cpu_threads=1",
]


def documented_sweeps() -> list[tuple[str, list[str]]]:
    """(where, arguments after ``kfac-bench train``) of every sweep command in the docs, continuation
    lines joined, comments (``# ...``) and comment markers dropped."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            text = line.lstrip("# ").strip()
            match = _SWEEP.search(text)
            if match is None:
                continue
            command = text[match.start() :]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].lstrip("# ").strip()
            command = command.split(" #")[0].strip().strip("`")
            found.append((f"{path.relative_to(ROOT)}:{i + 1}", shlex.split(command)[2:]))
    return found


#: Sweeps over the recipes ``kfac-bench tune`` writes (``--config-dir``) run in tests/harness/test_tune.py,
#: after the tune that writes them.
SWEEPS = [s for s in documented_sweeps() if "--config-dir" not in s[1]]
TUNED_SWEEPS = [s for s in documented_sweeps() if "--config-dir" in s[1]]


def test_the_docs_show_sweeps() -> None:
    where = {w.split(":")[0] for w, _ in SWEEPS + TUNED_SWEEPS}
    assert {"recipes/README.md", "configs/hydra/launcher/kfac_slurm.yaml"} <= where


def miniature(
    args: list[str], sweep_dir: Path, data: Path, config_dir: Path | None = None
) -> list[str]:
    """The sweep on this machine: the basic launcher in one process, one batch of each run (and
    ``config_dir`` for the one ``--config-dir`` names)."""
    if "--config-dir" in args:
        i = args.index("--config-dir")
        args = [*args[:i], *args[i + 2 :], f"--config-dir={config_dir}"]
    kept = [
        a
        for a in args
        if not a.startswith(("hydra/launcher=", "launcher=", "launcher.", "dataset.root="))
    ]
    recipes = next(a for a in kept if a.startswith("+recipe=")).split("=", 1)[1].split(",")
    family = {min((k for k in MINIATURE if r.startswith(k)), key=len, default="") for r in recipes}
    assert len(family) == 1 and "" not in family, f"no miniature for recipes {recipes}: add one"
    extra = MINIATURE[family.pop()]
    if any(e.startswith("dataset=") for e in extra):
        extra = [*extra, f"dataset.root={data}"]
    return [*kept, *COMMON, *extra, f"hydra.sweep.dir={sweep_dir}"]


def _leaves(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        out += _leaves(value, path) if isinstance(value, dict) else [(path, value)]
    return out


def _get(config: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        config = config[part]
    return config


@pytest.mark.slow
@pytest.mark.parametrize(("where", "args"), SWEEPS, ids=[w for w, _ in SWEEPS])
def test_a_documented_sweep_runs_a_tuned_baseline_against_kfac(
    where: str, args: list[str], tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    status = train_command.main(miniature(args, sweep, tmp_path / "data"))
    assert status == 0
    check_baselines(where, sweep)


def check_baselines(where: str, sweep: Path) -> None:
    """The sweep's runs include a first-order baseline and K-FAC, every baseline carries its own
    first-order tuning record, whose values its config has, and compare raises no fairness flag on any
    run."""
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert summaries, f"{where}: no run finished"
    baselines = [s for s in summaries if not s["kfac_enabled"]]
    assert baselines and len(baselines) < len(summaries), f"{where}: needs a baseline and K-FAC"
    for s in baselines:
        config, tuning = s["config"], s["config"]["tuning"]
        assert tuning["source"] and tuning["arm"] == config["optimizer"]["name"], (
            f"{where}: baseline {s['name']} has tuning record {tuning}, not its own first-order one"
        )
        for path, value in _leaves(tuning["values"]):
            if not path.startswith("kfac."):
                assert _get(config, path) == pytest.approx(value), f"{where}: {path}"
    flags = [f for s in summaries for f in run_flags(s, s["name"])]
    assert flags == [], f"{where}: compare flags {flags}"
