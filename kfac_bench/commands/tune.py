"""``kfac-bench tune``: tune both arms of a recipe on one budget and write the tuned pair as recipes.

Per arm (the first-order baseline ``NAME_sgd`` / ``NAME_lamb`` and the K-FAC recipe ``NAME``): a grid of
learning rates (K-FAC: x its damping) x seeds, run as a Hydra sweep (``kfac-bench train -m``, the basic
sweeper) in this process, every run stopping at its target (``train.stop_at_target``) within the same
budget of epochs. A grid point's objective is the median over seeds of the *censored* time to target: a
run that reached the target counts its time to target, one that missed counts its whole training time (it
took at least that long), a diverged run counts as never. Each arm's best point becomes a recipe in the
config dir the user names, ``NAME_tuned.yaml`` and ``NAME_sgd_tuned.yaml``: ``defaults: [NAME]`` plus the
tuned values and a ``tuning`` record whose source names the tune's command and folder, so that ``compare``
can tell a tuned baseline from one that is not. Every run records the tune's folder as its campaign.
"""

from __future__ import annotations

import argparse
import csv
import math
import shlex
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SUMMARY", "Point", "censored_time", "main", "score"]

SUMMARY = """\
  tune      tune each arm's LR (K-FAC: and damping) on one budget; write the tuned recipe pair
            kfac-bench tune +recipe=NAME [--lrs ..] [--dampings ..] [--seeds 0 1 2] [--epochs N]
            [--out DIR] [--out-config DIR] [key=value ...]"""

#: First-order siblings of a K-FAC recipe, in the order they are looked for.
_BASELINE_SUFFIXES = ("_sgd", "_lamb")


@dataclass(frozen=True)
class Arm:
    key: str  # "sgd", "lamb", ... or "kfac": the run folder under the tune's folder
    recipe: str
    kfac: bool


@dataclass
class Point:
    """One grid point of one arm: its runs' outcomes over seeds."""

    arm: str
    lr: float
    damping: float | None
    times: list[float] = field(default_factory=list)  # censored time to target per seed
    epochs: list[float] = field(
        default_factory=list
    )  # epochs to target of the seeds that reached it
    seeds: list[int] = field(default_factory=list)
    reached: int = 0

    @property
    def objective(self) -> float:
        """Median censored time to target over seeds (inf: no run, or most diverged)."""
        return statistics.median(self.times) if self.times else math.inf


def censored_time(summary: dict[str, Any]) -> float:
    """A run's time to target, censored: reached -> its time to target; missed -> its whole training
    (wall) time, a lower bound; diverged -> inf (never)."""
    if summary.get("reached_target"):
        return float(summary["time_to_target_s"])
    if summary.get("status") == "diverged":
        return math.inf
    return float(summary["wall_time_s"])


def score(summaries: Sequence[dict[str, Any]], arm: str) -> list[Point]:
    """The grid points of ``arm``'s run summaries, best first (lowest objective, then more seeds
    reaching the target, then the lower LR)."""
    points: dict[tuple[float, float | None], Point] = {}
    for s in summaries:
        config = s["config"]
        lr = float(config["optimizer"]["lr"])
        damping = float(config["kfac"]["damping"]) if s.get("kfac_enabled") else None
        p = points.setdefault((lr, damping), Point(arm, lr, damping))
        p.times.append(censored_time(s))
        p.seeds.append(int(config["train"]["seed"]))
        if s.get("reached_target"):
            p.reached += 1
            p.epochs.append(float(s["epochs_to_target"]))
    return sorted(points.values(), key=lambda p: (p.objective, -p.reached, p.lr))


def _parse(args: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kfac-bench tune",
        description="Tune the learning rate of a recipe's first-order baseline (NAME_sgd / NAME_lamb) and "
        "of its K-FAC arm (NAME; also the damping) on one grid, seeds and budget, then write the tuned "
        "recipes NAME_sgd_tuned and NAME_tuned into a config dir.",
    )
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        help="LR grid (default: both recipes' LRs / 2 to x 2, in factors of 2)",
    )
    parser.add_argument(
        "--dampings",
        type=float,
        nargs="+",
        help="K-FAC damping grid (default: the recipe's / 3, x 1, x 3)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values (default 0 1 2)"
    )
    parser.add_argument(
        "--epochs", type=int, help="the budget, train.epochs of every run (default: the recipes')"
    )
    parser.add_argument(
        "--baseline",
        metavar="RECIPE",
        help="the first-order recipe (default: NAME_sgd, else NAME_lamb)",
    )
    parser.add_argument(
        "--out",
        help="the tune's folder: sweeps, tune.md/.csv/.png (default: runs/tune_<time>_<uid>)",
    )
    parser.add_argument(
        "--out-config",
        metavar="DIR",
        help="config dir for the tuned recipes, written to DIR/recipe/ (default: OUT/config)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="+recipe=NAME and config overrides for every run",
    )
    ns = parser.parse_intermixed_args(list(args))
    if ns.epochs is not None and ns.epochs < 1:
        parser.error(f"--epochs {ns.epochs}: must be >= 1")
    return ns


def _recipe(overrides: list[str]) -> tuple[str, list[str]]:
    from kfac_bench.errors import UserError

    names = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")]
    if len(names) != 1 or "," in names[0]:
        raise UserError("tune: name one K-FAC recipe, e.g. kfac-bench tune +recipe=digits")
    return names[0], [o for o in overrides if not o.lstrip("+").startswith("recipe=")]


def _arms(
    name: str, baseline: str | None, overrides: list[str]
) -> tuple[list[Arm], dict[str, Any]]:
    """The two arms, baseline first, and each arm's composed config.

    Raises:
        UserError: ``name`` runs no K-FAC, the baseline is not found or runs K-FAC.
    """
    from kfac_bench.config.compose import compose_run
    from kfac_bench.config.store import recipe_names
    from kfac_bench.errors import UserError

    kfac_cfg = compose_run([f"+recipe={name}", *overrides])
    if not kfac_cfg.kfac.enabled:
        raise UserError(
            f"tune: recipe {name} runs no K-FAC; name the K-FAC recipe (e.g. digits, not digits_sgd)"
        )
    if baseline is None:
        stem, smoke = (
            (name.removesuffix("_smoke"), "_smoke") if name.endswith("_smoke") else (name, "")
        )
        found = [stem + s + smoke for s in _BASELINE_SUFFIXES if stem + s + smoke in recipe_names()]
        if not found:
            tried = ", ".join(stem + s + smoke for s in _BASELINE_SUFFIXES)
            raise UserError(
                f"tune: no first-order recipe for {name} ({tried}); name one with --baseline RECIPE"
            )
        baseline = found[0]
    base_cfg = compose_run([f"+recipe={baseline}", *overrides])
    if base_cfg.kfac.enabled:
        raise UserError(f"tune: --baseline {baseline} runs K-FAC; name a first-order recipe")
    key = str(base_cfg.optimizer.name.value).lower()
    arms = [Arm(key, baseline, False), Arm("kfac", name, True)]
    return arms, {key: base_cfg, "kfac": kfac_cfg}


def _grid(values: Sequence[float]) -> list[float]:
    """Powers of two times the smallest value, from half the smallest to twice the largest."""
    low, high = min(values) / 2, max(values) * 2
    out = [low]
    while out[-1] * 2 <= high * (1 + 1e-9):
        out.append(out[-1] * 2)
    return [float(f"{v:.4g}") for v in out]


def _sweep(
    arm: Arm,
    ns: argparse.Namespace,
    lrs: list[float],
    dampings: list[float],
    out: Path,
    rest: list[str],
) -> int:
    from kfac_bench.commands import train as train_command
    from kfac_bench.config import hydra_quote

    args = [
        "-m",
        f"+recipe={arm.recipe}",
        f"optimizer.lr={','.join(f'{v:g}' for v in lrs)}",
        *([f"kfac.damping={','.join(f'{v:g}' for v in dampings)}"] if arm.kfac else []),
        f"train.seed={','.join(str(s) for s in ns.seeds)}",
        *([f"train.epochs={ns.epochs}"] if ns.epochs else []),
        "train.stop_at_target=true",
        "train.progress=none",
        f"train.campaign={hydra_quote(str(out))}",
        f"hydra.sweep.dir={hydra_quote(str(out / arm.key))}",
        *rest,
    ]
    print(f"kfac-bench tune: {arm.key}: kfac-bench train {shlex.join(args)}", flush=True)
    return train_command.main(args)


def _write_recipe(path: Path, parent: str, cfg: Any, best: Point, arm: str, source: str) -> None:
    """``path``: recipe ``parent`` with ``best``'s values and their tuning record."""
    import yaml
    from omegaconf import OmegaConf

    record = OmegaConf.to_container(cfg.tuning, resolve=True)
    values: dict[str, Any] = dict(record.get("values") or {})  # type: ignore[union-attr]
    values["optimizer"] = {**values.get("optimizer", {}), "lr": best.lr}
    tuned: dict[str, Any] = {"optimizer": {"lr": best.lr}}
    if best.damping is not None:
        values["kfac"] = {**values.get("kfac", {}), "damping": best.damping}
        tuned["kfac"] = {"damping": best.damping}
    body = {
        "defaults": [parent, "_self_"],
        "name": path.stem,
        **tuned,
        "tuning": {"arm": arm, "source": source, "values": values},
    }
    header = (
        "# @package _global_\n"
        f"# kfac-bench train +recipe={path.stem} --config-dir {path.parent.parent}\n"
        f"# Written by kfac-bench tune: recipe {parent} at its best grid point (median censored time to\n"
        "# target over seeds).\n"
    )
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))


def _table(points: list[Point], best: dict[str, Point], budget: str) -> tuple[str, list[list[Any]]]:
    head = [
        "arm",
        "lr",
        "damping",
        "seeds",
        "reached",
        "median censored time to target (s)",
        "median epochs to target",
        "best",
    ]
    rows = []
    for p in points:
        rows.append(
            [
                p.arm,
                f"{p.lr:g}",
                "" if p.damping is None else f"{p.damping:g}",
                " ".join(str(s) for s in sorted(p.seeds)),
                f"{p.reached}/{len(p.times)}",
                "diverged" if math.isinf(p.objective) else f"{p.objective:.2f}",
                f"{statistics.median(p.epochs):g}" if p.epochs else "-",
                "*" if best[p.arm] is p else "",
            ]
        )
    lines = [
        f"Budget: {budget}. Objective: median over seeds of the censored time to target (a run that missed "
        "counts its whole training time, a diverged one never).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    return "\n".join(lines) + "\n", [head, *rows]


def _plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple[str, float | None], list[Point]] = {}
    for p in points:
        lines.setdefault((p.arm, p.damping), []).append(p)
    for (arm, damping), pts in sorted(lines.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        pts.sort(key=lambda p: p.lr)
        label = arm if damping is None else f"{arm}, damping {damping:g}"
        finite = [p for p in pts if not math.isinf(p.objective)]
        (line,) = ax.plot(
            [p.lr for p in finite], [p.objective for p in finite], marker="o", label=label
        )
        missed = [p for p in finite if p.reached < len(p.times)]
        ax.plot(
            [p.lr for p in missed],
            [p.objective for p in missed],
            "x",
            color=line.get_color(),
            ms=10,
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("median censored time to target (s)")
    ax.set_title("tune: x = some seeds missed the target (time is a lower bound)", fontsize=9)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: Sequence[str]) -> int:
    """``kfac-bench tune ARGS``; returns the exit status (the first failed sweep's)."""
    import json

    from kfac_bench.config.resolvers import unique_suffix
    from kfac_bench.errors import UserError

    ns = _parse(args)
    name, rest = _recipe(ns.overrides)
    arms, cfgs = _arms(name, ns.baseline, rest)
    lrs = sorted(ns.lrs) if ns.lrs else _grid([float(c.optimizer.lr) for c in cfgs.values()])
    base_damping = float(cfgs["kfac"].kfac.damping)
    dampings = (
        sorted(ns.dampings)
        if ns.dampings
        else [float(f"{base_damping * f:.3g}") for f in (1 / 3, 1, 3)]
    )
    out = (
        Path(ns.out)
        if ns.out
        else Path("runs") / f"tune_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{unique_suffix()}"
    )
    if out.exists() and any(out.iterdir()):
        raise UserError(f"tune: --out {out} is not empty; choose a new folder")
    config_out = Path(ns.out_config) if ns.out_config else out / "config"
    out.mkdir(parents=True, exist_ok=True)
    epochs = ns.epochs or int(cfgs["kfac"].train.epochs)
    seeds = " ".join(str(s) for s in ns.seeds)
    budget = f"{epochs} epochs, seeds {seeds}, target {dict(cfgs['kfac'].train.targets)}"
    for arm in arms:
        status = _sweep(arm, ns, lrs, dampings, out, rest)
        if status != 0:
            return status
    points: list[Point] = []
    best: dict[str, Point] = {}
    for arm in arms:
        summaries = [
            json.loads(p.read_text()) for p in sorted((out / arm.key).glob("*/summary.json"))
        ]
        ranked = score(summaries, arm.key)
        if not ranked:
            raise UserError(f"tune: no run of {arm.recipe} finished (see {out / arm.key})")
        best[arm.key] = ranked[0]
        points += ranked
    command = shlex.join(["kfac-bench", "tune", *args])
    markdown, rows = _table(points, best, budget)
    (out / "tune.md").write_text(f"# {command}\n\n{markdown}")
    with (out / "tune.csv").open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    _plot(points, out / "tune.png")
    (config_out / "recipe").mkdir(parents=True, exist_ok=True)
    written = []
    for arm in arms:
        path = config_out / "recipe" / f"{arm.recipe}_tuned.yaml"
        source = f"{command} ({out}: {budget})"
        _write_recipe(path, arm.recipe, cfgs[arm.key], best[arm.key], arm.key, source)
        written.append(path.stem)
    print(markdown, end="")
    for arm in arms:
        if best[arm.key].reached == 0:
            print(
                f"kfac-bench tune: warning: no {arm.key} run reached the target within {epochs} epochs, "
                "so its choice says nothing; give a larger --epochs or a wider grid"
            )
    print(f"wrote {out / 'tune.md'}, {out / 'tune.csv'}, {out / 'tune.png'}")
    print(
        f"kfac-bench tune: tuned recipes {', '.join(written)} in {config_out}; run them with\n"
        f"  kfac-bench train -m +recipe={','.join(written)} train.seed=0,1,2 --config-dir {config_out}"
    )
    return 0
