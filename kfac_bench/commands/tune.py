"""``kfac-bench tune``: tune both arms of a recipe on one budget and write the tuned pair as recipes.

Per arm (the first-order baseline ``NAME_sgd`` / ``NAME_lamb`` and the K-FAC recipe ``NAME``): a grid of
learning rates (K-FAC: x its damping) x seeds, every run stopping at its target (``train.stop_at_target``)
within the same budget of epochs. tune runs the jobs itself, one ``kfac-bench train`` run each in this
process, the two arms' jobs interleaved in time (seed by seed, spread evenly over the run) so that a change
of the machine's load falls on both arms alike. Each job has its own run directory under the tune's folder
(``ARM/lr<LR>[_damping<D>]_seed<S>``), so a tune started again on the same folder (after a kill or a
SIGTERM: the current job checkpoints, no other starts, exit 75) continues from its finished runs and resumes
the interrupted one; ``tune.json`` records the grid and a different one is refused there.

Each arm's points are ranked by :mod:`kfac_bench.commands.tuning.rank`: seeds reaching the target, then the
median epochs to target, the clock only as a tie-break where its interval separates. The winners become
recipes in the config dir the user names, ``NAME_tuned.yaml`` and ``NAME_sgd_tuned.yaml``: ``defaults:
[NAME]``, the values the winning runs ran where they differ from the recipe, and a ``tuning`` record holding
exactly those runs' ``optimizer``/``lr_schedule`` (and ``kfac``) values and a source naming the tune. The
pair is written as a unit, both or neither, under a lock that refuses a second tune into the same config
dir; an arm none of whose points reached the target gets no recipe (one line naming what to widen, exit 1).
Every file goes through :mod:`kfac_bench.safe_files` (no link followed, atomic replace). Every run records
the tune's folder as its campaign.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_bench.commands.tuning import files as tune_files
from kfac_bench.commands.tuning.rank import (
    Point,
    Ranking,
    censored_time,
    plot_png,
    points_of,
    rank,
    table,
)

__all__ = ["EXIT_NOT_REACHED", "SUMMARY", "Point", "censored_time", "main", "score"]

SUMMARY = """\
  tune      tune each arm's LR (K-FAC: and damping) on one budget; write the tuned recipe pair
            kfac-bench tune +recipe=NAME [--lrs ..] [--dampings ..] [--seeds 0 1 2] [--epochs N]
            [--out DIR] [--out-config DIR] [--config-dir DIR ...] [key=value ...]"""

#: First-order siblings of a K-FAC recipe, in the order they are looked for.
_BASELINE_SUFFIXES = ("_sgd", "_lamb")
#: Exit status when an arm has no point that reached the target: no tuned recipe was written.
EXIT_NOT_REACHED = 1


@dataclass(frozen=True)
class Arm:
    key: str  # "sgd", "lamb", ... or "kfac": the run folder under the tune's folder
    recipe: str
    kfac: bool

    @property
    def sections(self) -> tuple[str, ...]:
        """The config sections a tuning of this arm fixes (what its tuning record holds)."""
        return ("optimizer", "lr_schedule", "kfac") if self.kfac else ("optimizer", "lr_schedule")


def score(summaries: Sequence[dict[str, Any]], arm: str) -> list[Point]:
    """The grid points of ``arm``'s run summaries, best first (:func:`.tuning.rank.rank`)."""
    return rank(points_of(summaries, arm)).points


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
        help="the tune's folder: runs, tune.md/.csv/.png; started again on the same folder, a tune "
        "continues (default: runs/tune_<time>_<uid>)",
    )
    parser.add_argument(
        "--out-config",
        metavar="DIR",
        help="config dir for the tuned recipes, written to DIR/recipe/ (default: the --config-dir holding "
        "the recipe, else OUT/config)",
    )
    parser.add_argument(
        "--config-dir",
        "-cd",
        dest="config_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="a config dir of your own recipes, models, datasets (DIR/recipe/NAME.yaml; repeatable)",
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
    for flag, values in (("--lrs", ns.lrs), ("--dampings", ns.dampings)):
        if values and not all(math.isfinite(v) and v > 0 for v in values):
            parser.error(f"{flag}: every value must be a positive number")
    twice = sorted({s for s in ns.seeds if ns.seeds.count(s) > 1})
    if twice:
        # A seed run twice is one sample counted twice: it would narrow nothing and pair twice.
        print(
            f"kfac-bench tune: seed(s) {' '.join(map(str, twice))} given twice, run once",
            flush=True,
        )
        ns.seeds = list(dict.fromkeys(ns.seeds))
    ns.config_dirs = [str(Path(d).resolve()) for d in ns.config_dirs]
    return ns


def _recipe(overrides: list[str]) -> tuple[str, list[str]]:
    from kfac_bench.errors import UserError

    names = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")]
    if len(names) != 1 or "," in names[0]:
        raise UserError("tune: name one K-FAC recipe, e.g. kfac-bench tune +recipe=digits")
    return names[0], [o for o in overrides if not o.lstrip("+").startswith("recipe=")]


def _recipe_home(name: str, config_dirs: Sequence[str]) -> str | None:
    """The user's config dir that holds recipe ``name`` (the last given wins, as on Hydra's search
    path), or None: a recipe of the package."""
    homes = [d for d in config_dirs if (Path(d) / "recipe" / f"{name}.yaml").is_file()]
    return homes[-1] if homes else None


def _recipe_known(name: str, config_dirs: Sequence[str]) -> bool:
    from kfac_bench.config.store import recipe_names

    return name in recipe_names() or _recipe_home(name, config_dirs) is not None


def _arms(
    name: str, baseline: str | None, overrides: list[str], config_dirs: Sequence[str] = ()
) -> tuple[list[Arm], dict[str, Any]]:
    """The two arms, baseline first, and each arm's composed config (the user's ``config_dirs`` on the
    search path: a recipe, and its baseline, may be the user's own).

    Raises:
        UserError: ``name`` runs no K-FAC, the baseline is not found or runs K-FAC.
    """
    from kfac_bench.config.compose import compose_run
    from kfac_bench.errors import UserError

    kfac_cfg = compose_run([f"+recipe={name}", *overrides], config_dirs=config_dirs)
    if not kfac_cfg.kfac.enabled:
        raise UserError(
            f"tune: recipe {name} runs no K-FAC; name the K-FAC recipe (e.g. digits, not digits_sgd)"
        )
    if baseline is None:
        stem, smoke = (
            (name.removesuffix("_smoke"), "_smoke") if name.endswith("_smoke") else (name, "")
        )
        tried = [stem + s + smoke for s in _BASELINE_SUFFIXES]
        found = [t for t in tried if _recipe_known(t, config_dirs)]
        if not found:
            where = " in the package or " + ", ".join(config_dirs) if config_dirs else ""
            raise UserError(
                f"tune: no first-order recipe for {name} ({', '.join(tried)}{where}); name one with "
                "--baseline RECIPE"
            )
        baseline = found[0]
    base_cfg = compose_run([f"+recipe={baseline}", *overrides], config_dirs=config_dirs)
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


@dataclass(frozen=True)
class Job:
    """One run of the grid: an arm at a point and a seed, in its own run directory."""

    arm: Arm
    lr: float
    damping: float | None
    seed: int

    @property
    def folder(self) -> str:
        damping = "" if self.damping is None else f"_damping{self.damping:g}"
        return f"lr{self.lr:g}{damping}_seed{self.seed}"


def _grid_record(
    name: str, arms: Sequence[Arm], ns: argparse.Namespace, lrs: list[float], dampings: list[float]
) -> dict[str, Any]:
    return {
        "recipe": name,
        "baseline": arms[0].recipe,
        "lrs": lrs,
        "dampings": dampings,
        "seeds": list(ns.seeds),
        "epochs": ns.epochs,
        "overrides": list(ns.overrides),
        "config_dirs": list(ns.config_dirs),
    }


def _jobs(
    arms: Sequence[Arm], lrs: Sequence[float], dampings: Sequence[float], seeds: Sequence[int]
) -> list[Job]:
    """Every arm's runs, seed by seed, the arms interleaved in time: each arm's runs spread evenly over the
    whole tune (the arm with more points runs more often, never in a block of its own), and at equal
    places the arms alternate which goes first."""
    per_arm = [
        [
            Job(arm, lr, d, seed)
            for seed in seeds
            for lr in lrs
            for d in (dampings if arm.kfac else [None])
        ]
        for arm in arms
    ]
    placed = [
        ((i + 0.5) / len(jobs), (a + i) % len(per_arm), job)
        for a, jobs in enumerate(per_arm)
        for i, job in enumerate(jobs)
    ]
    return [job for *_, job in sorted(placed, key=lambda t: (t[0], t[1]))]


def _finished(run_dir: Path) -> dict[str, Any] | None:
    """The summary of a finished run in ``run_dir`` (reached, missed or diverged), else None."""
    from kfac_bench.safe_files import read_head

    text = read_head(run_dir / "summary.json", 1 << 22)
    if text is None:
        return None
    try:
        summary = json.loads(text)
    except ValueError:
        return None
    if not isinstance(summary, dict):
        return None
    ok = summary.get("status") in ("success", "target_not_reached", "diverged")
    return summary if ok else None


def _job_args(job: Job, ns: argparse.Namespace, out: Path, rest: list[str]) -> list[str]:
    from kfac_bench.config import hydra_quote

    return [
        *(f"--config-dir={d}" for d in ns.config_dirs),
        f"+recipe={job.arm.recipe}",
        f"optimizer.lr={job.lr:g}",
        *([f"kfac.damping={job.damping:g}"] if job.damping is not None else []),
        f"train.seed={job.seed}",
        *([f"train.epochs={ns.epochs}"] if ns.epochs else []),
        "train.stop_at_target=true",
        "train.progress=none",
        f"train.campaign={hydra_quote(str(out))}",
        f"hydra.run.dir={hydra_quote(str(out / job.arm.key / job.folder))}",
        *rest,
    ]


def _run_jobs(
    jobs: Sequence[Job], ns: argparse.Namespace, out: Path, rest: list[str]
) -> tuple[int, int]:
    """Run the jobs not finished yet, in order; returns (exit status, jobs run). A stop signal (SIGTERM,
    SIGINT, SIGUSR1/2) checkpoints the current job (the run's own handling: it exits 75) and starts no
    other: the status is then 75. A job that fails stops the tune with its status."""
    from kfac_bench.commands import train as train_command
    from kfac_bench.launcher.signals import EXIT_REQUEUE, PreemptionFlag

    # A run installs its own flag over this one and hands the signal back to it when it has stopped.
    flag = PreemptionFlag().install()
    ran = 0
    try:
        for n, job in enumerate(jobs, 1):
            if flag.signum is not None:
                return EXIT_REQUEUE, ran
            if _finished(out / job.arm.key / job.folder) is not None:
                continue
            args = _job_args(job, ns, out, rest)
            print(f"kfac-bench tune: run {n}/{len(jobs)}: kfac-bench train {shlex.join(args)}")
            status = train_command.main(args)
            ran += 1
            if status == EXIT_REQUEUE or flag.signum is not None:
                return EXIT_REQUEUE, ran
            if status != 0:
                return status, ran
    finally:
        flag.restore()
    return 0, ran


def _config_out(ns: argparse.Namespace, out: Path) -> Path:
    """Where the tuned recipes go: ``--out-config``, else the user's config dir (the last ``--config-dir``,
    the one a run reads), else ``OUT/config``. A run of the tuned pair reads one config dir, which must
    hold the pair and whatever of the user's the recipes use.

    Raises:
        UserError: ``--out-config`` is not the user's config dir.
    """
    from kfac_bench.errors import UserError

    own = Path(ns.config_dirs[-1]) if ns.config_dirs else None
    if ns.out_config:
        config_out = Path(ns.out_config).resolve()
        if own is not None and config_out != own:
            raise UserError(
                f"tune: --out-config {ns.out_config} is not your --config-dir {own}, and a run of the "
                f"tuned recipes reads one config dir: give --out-config {own} (or leave it out)"
            )
        return config_out
    return own if own is not None else out / "config"


def main(args: Sequence[str]) -> int:
    """``kfac-bench tune ARGS``; returns the exit status: 0, 75 when stopped by a signal (started again
    on the same ``--out`` it continues), :data:`EXIT_NOT_REACHED` when an arm never reached the target,
    else the first failed run's."""
    from kfac_bench.errors import UserError
    from kfac_bench.safe_files import new_folder_name

    ns = _parse(args)
    name, rest = _recipe(ns.overrides)
    arms, cfgs = _arms(name, ns.baseline, rest, ns.config_dirs)
    lrs = sorted(set(ns.lrs)) if ns.lrs else _grid([float(c.optimizer.lr) for c in cfgs.values()])
    base_damping = float(cfgs["kfac"].kfac.damping)
    dampings = (
        sorted(set(ns.dampings))
        if ns.dampings
        else [float(f"{base_damping * f:.3g}") for f in (1 / 3, 1, 3)]
    )
    out = Path(ns.out) if ns.out else Path("runs") / new_folder_name("tune")
    if os.path.islink(out):
        raise UserError(f"tune: --out {out} is a symbolic link; give a folder of its own")
    if out.exists() and not out.is_dir():
        raise UserError(
            f"tune: --out '{out}' is a file, not a folder: give a folder for the tune's runs"
        )
    config_out = _config_out(ns, out)
    with contextlib.ExitStack() as stack:  # every folder checked (and locked) before any run
        grid = _grid_record(name, arms, ns, lrs, dampings)
        again = tune_files.claim_out(out, grid)
        stack.enter_context(
            tune_files.held(out / tune_files.LOCK_FILE, f"tune: another tune is running in {out}")
        )
        recipes = stack.enter_context(tune_files.config_lock(config_out))
        jobs = _jobs(arms, lrs, dampings, ns.seeds)
        if again:
            done = sum(_finished(out / j.arm.key / j.folder) is not None for j in jobs)
            print(f"kfac-bench tune: continuing {out}: {done} of {len(jobs)} runs finished")
        status, _ = _run_jobs(jobs, ns, out, rest)
        if status != 0:
            if status == 75:
                print(
                    f"kfac-bench tune: stopped; the current run checkpointed. Run the same command to "
                    f"continue {out}",
                    flush=True,
                )
            return status
        return _report(args, ns, arms, cfgs, jobs, out, recipes)


def _report(
    args: Sequence[str],
    ns: argparse.Namespace,
    arms: list[Arm],
    cfgs: dict[str, Any],
    jobs: list[Job],
    out: Path,
    recipes: Path,
) -> int:
    """Rank each arm's points, write tune.md/.csv/.png and (when every arm reached the target) the tuned
    pair; returns the exit status."""
    from omegaconf import OmegaConf

    from kfac_bench import safe_files
    from kfac_bench.config.compose import compose_run
    from kfac_bench.errors import UserError

    epochs = ns.epochs or int(cfgs["kfac"].train.epochs)
    seeds = " ".join(str(s) for s in ns.seeds)
    budget = f"{epochs} epochs, seeds {seeds}, target {dict(cfgs['kfac'].train.targets)}"
    rankings: dict[str, Ranking] = {}
    for arm in arms:
        summaries = [
            s
            for j in jobs
            if j.arm == arm
            if (s := _finished(out / arm.key / j.folder)) is not None
        ]
        if not summaries:
            raise UserError(f"tune: no run of {arm.recipe} finished (see {out / arm.key})")
        rankings[arm.key] = rank(points_of(summaries, arm.key))
    command = shlex.join(["kfac-bench", "tune", *args])
    markdown, rows = table(rankings, budget)
    safe_files.write_atomic(out / "tune.md", f"# {command}\n\n{markdown}")
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    safe_files.write_atomic(out / "tune.csv", text.getvalue())
    safe_files.write_atomic(
        out / "tune.png", plot_png([p for r in rankings.values() for p in r.points])
    )
    print(markdown, end="")
    print(f"wrote {out / 'tune.md'}, {out / 'tune.csv'}, {out / 'tune.png'}")
    missed = [arm for arm in arms if not rankings[arm.key].reached]
    if missed:
        arm = missed[0]
        widen = f"--lrs (tried {min(p.lr for p in rankings[arm.key].points):g} to "
        widen += f"{max(p.lr for p in rankings[arm.key].points):g})"
        if arm.kfac:
            widen += " or --dampings"
        print(
            f"kfac-bench tune: no {arm.key} grid point ({arm.recipe}) reached the target within {epochs} "
            f"epochs, so no tuned recipe was written: widen {widen} or raise --epochs",
            flush=True,
        )
        return EXIT_NOT_REACHED
    run_flags = f"--config-dir {shlex.quote(str(recipes.parent))}"
    source = f"{command} ({out}: {budget})"
    texts: dict[str, str] = {}
    for arm in arms:
        stem = f"{arm.recipe}_tuned"
        parent_cfg = OmegaConf.to_container(
            compose_run([f"+recipe={arm.recipe}"], config_dirs=ns.config_dirs), resolve=True
        )
        best = rankings[arm.key].best
        assert best is not None and isinstance(parent_cfg, dict)
        texts[stem] = tune_files.recipe_text(
            stem,
            arm.recipe,
            {str(k): v for k, v in parent_cfg.items()},
            best,
            arm.sections,
            arm.key,
            source,
            f"kfac-bench train +recipe={stem} {run_flags}",
        )
    tune_files.write_pair(recipes, texts)
    fresh = list(range(max(ns.seeds) + 1, max(ns.seeds) + 1 + max(3, len(ns.seeds))))
    print(
        f"kfac-bench tune: tuned recipes {', '.join(texts)} in {recipes}; compare them on fresh seeds "
        f"(not the tuning's), a seed's two arms back to back:\n"
        f"  kfac-bench train -m train.seed={','.join(map(str, fresh))} "
        f"+recipe={','.join(texts)} {run_flags}"
    )
    return 0
