"""``kfac-bench demo``: the bundled demonstration behind ``make train``.

Both arms of the digits benchmark, SGD (``recipes/digits_sgd.yaml``) and SGD + K-FAC
(``recipes/digits.yaml``), with the same data, batch and LR schedule, each at its best learning rate from
the grid search (``python -m benchmarks.digits_grid``), over several seeds; then ``kfac-bench compare`` on
the run directories. Every run is a normal run (the ``train`` path: composed from the recipe, checked,
trained by :func:`kfac_bench.train.run.train` into its own run directory with ``summary.json`` and
``eval.jsonl``), all in this one process, so the imports are paid once. The arms alternate seed by seed, so a
change in the machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "SUMMARY", "main"]

SUMMARY = """\
  demo      the bundled demo (make train): digits, SGD vs SGD + K-FAC x 3 seeds, then the comparison
            kfac-bench demo [--seeds 0 1 2] [--epochs N] [--out DIR] [key=value ...]"""

#: (run directory prefix, recipe) of each arm, baseline first.
ARMS: tuple[tuple[str, str], ...] = (("sgd", "digits_sgd"), ("kfac", "digits"))


def _parse(args: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kfac-bench demo",
        description="Train both arms of the digits benchmark (SGD: recipe digits_sgd; SGD + K-FAC: recipe "
        "digits) for each seed, alternating arms, then compare them (kfac-bench compare).",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values (default 0 1 2)"
    )
    parser.add_argument(
        "--epochs", type=int, help="train.epochs for both arms (default: the recipes', 30)"
    )
    parser.add_argument(
        "--out",
        help="folder for the run directories and compare.md/.csv/.png (default: runs/demo_<time>_<uid>)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides for both arms"
    )
    ns = parser.parse_args(list(args))
    if ns.epochs is not None and ns.epochs < 1:
        parser.error(f"--epochs {ns.epochs}: must be >= 1")
    return ns


def _configs(ns: argparse.Namespace) -> list[tuple[str, int, Any]]:
    """(arm, seed, composed and checked config) of every run, in the order they run.

    Raises:
        ConfigError: a bad override (before anything trains).
    """
    from kfac_bench.config.compose import compose_run
    from kfac_bench.launcher.preflight import check_run

    common = ["train.progress=none"] + ([f"train.epochs={ns.epochs}"] if ns.epochs else [])
    runs = []
    for seed in ns.seeds:
        for arm, recipe in ARMS:
            cfg = compose_run([f"+recipe={recipe}", f"train.seed={seed}", *common, *ns.overrides])
            check_run(cfg)
            runs.append((arm, seed, cfg))
    return runs


def _out_dir(given: str | None) -> Path:
    from kfac_bench.config.resolvers import unique_suffix
    from kfac_bench.errors import UserError

    if given is None:
        return Path("runs") / f"demo_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{unique_suffix()}"
    out = Path(given)
    if out.exists() and any(out.iterdir()):
        raise UserError(
            f"--out {out} is not empty; choose a new folder (the demo's runs start afresh)"
        )
    return out


def main(args: Sequence[str]) -> int:
    """``kfac-bench demo ARGS``; returns the exit status (the first failed run's)."""
    ns = _parse(args)
    runs = _configs(ns)
    out = _out_dir(ns.out)
    from kfac_bench.compare.report import find_runs, write_outputs
    from kfac_bench.train.run import train

    if any(cfg.train.tensorboard for _, _, cfg in runs):
        # TensorBoard's writer is imported at a run's first scalar, inside its clock: pay it once here.
        import torch.utils.tensorboard  # noqa: F401

    started = time.perf_counter()
    dirs: list[Path] = []
    for arm, seed, cfg in runs:
        run_dir = out / f"{arm}_seed{seed}"
        print(f"kfac-bench demo: {arm} seed {seed} ({len(dirs) + 1}/{len(runs)})", flush=True)
        status = train(cfg, run_dir)
        if status != 0:
            return status
        dirs.append(run_dir)
    trained = time.perf_counter() - started
    print()
    print(write_outputs(find_runs(dirs), out), end="")
    print(f"kfac-bench demo: {len(dirs)} runs in {trained:.0f} s; results in {out}")
    return 0
