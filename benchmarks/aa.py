"""A/A test of a comparison's design: how often does ``kfac-bench compare`` claim a difference between two
identical arms?

Run ``python -m benchmarks.aa`` (``--quick`` for a smoke run). Each campaign trains one recipe (default
``digits``, the bundled job, to its target with ``train.stop_at_target``) as two arms that differ only in
their name (``name=aa_A,aa_B``), ``--seeds`` seeds each, then runs ``kfac-bench compare`` on it and reads
the non-baseline arm's ``claim`` from ``compare.csv`` (``faster``, ``slower`` or ``none``). Any claim is a
false claim. Designs (``--designs``):

* ``interleaved``: one ``kfac-bench train -m`` sweep, which runs a seed's two arms back to back;
* ``blocked``: all of arm A's seeds, then all of arm B's (two sweeps, one campaign): the design a change of
  machine load turns into a difference, which ``compare``'s schedule check must refuse to claim on.

With ``--load-shift`` (default on), a CPU load of one busy process per core starts when half of a
campaign's runs have finished and stops at its end: the drift that a blocked design cannot separate from
the arms. It prints each campaign's claim and ratio, then per design the false-claim rate with its exact
(Clopper-Pearson) 95 % interval.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from scipy.stats import beta

DESIGNS = ("interleaved", "blocked")


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("kfac-bench")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kfac_bench.cli"]


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact two-sided ``level`` interval of a rate seen ``k`` times in ``n``."""
    a = (1 - level) / 2
    low = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k))
    return low, high


class LoadShift:
    """One busy process per core, started once ``half`` summaries exist under ``folder``."""

    def __init__(self, folder: Path, half: int) -> None:
        self.folder, self.half = folder, half
        self.burners: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadShift:
        self._watch.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            if sum(1 for _ in self.folder.rglob("summary.json")) >= self.half:
                busy = "while True: pass"
                self.burners = [
                    subprocess.Popen([sys.executable, "-c", busy])
                    for _ in range(os.cpu_count() or 1)
                ]
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._watch.join()
        for p in self.burners:
            p.kill()
            p.wait()


def _train(args: Sequence[str]) -> None:
    done = subprocess.run([*_cli(), "train", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kfac-bench train failed ({done.returncode}): {done.stderr[-1500:]}")


def campaign(
    folder: Path, design: str, recipe: str, seeds: list[int], extra: Sequence[str]
) -> None:
    """Train one A/A campaign of ``design`` into ``folder``."""
    common = [
        f"+recipe={recipe}",
        "train.stop_at_target=true",
        "train.progress=none",
        "train.tensorboard=false",
        "train.cpu_threads=1",
        f"train.campaign={folder.name}",
        *extra,
    ]
    seed_list = ",".join(str(s) for s in seeds)
    if design == "interleaved":
        _train(
            [
                "-m",
                "name=aa_A,aa_B",
                f"train.seed={seed_list}",
                *common,
                f"hydra.sweep.dir={folder}",
            ]
        )
        return
    for arm in ("aa_A", "aa_B"):
        _train(
            [
                "-m",
                f"name={arm}",
                f"train.seed={seed_list}",
                *common,
                f"hydra.sweep.dir={folder / arm}",
            ]
        )


def claim(folder: Path) -> tuple[str, str]:
    """(claim, time ratio with its interval) of arm aa_B against aa_A, from compare.csv."""
    out = folder / "cmp"
    done = subprocess.run(
        [
            *_cli(),
            "compare",
            str(folder),
            "--baseline",
            "aa_A",
            "--out",
            str(out),
            "--format",
            "csv",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kfac-bench compare failed: {done.stderr[-1500:]}")
    with open(out / "compare.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("run") == "aa_B"]
    if not rows:
        raise RuntimeError(f"compare.csv in {out} has no aa_B row")
    r = rows[0]
    low, mid, high = (
        float(r[k]) for k in ("time_ratio_ci_low", "time_ratio", "time_ratio_ci_high")
    )
    ratio = f"{mid:.2f} [{low:.2f}-{high:.2f}]"
    return r["claim"], ratio


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.aa", description=__doc__)
    parser.add_argument("--campaigns", type=int, default=20, help="campaigns per design (20)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per arm (5)")
    parser.add_argument("--recipe", default="digits", help="the recipe both arms train (digits)")
    parser.add_argument("--designs", nargs="+", choices=DESIGNS, default=list(DESIGNS))
    parser.add_argument("--no-load-shift", dest="load_shift", action="store_false")
    parser.add_argument("--quick", action="store_true", help="2 campaigns x 2 seeds: a smoke run")
    parser.add_argument("--out", help="folder for the campaigns (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the campaigns' folders")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for both arms")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.campaigns, ns.seeds = 2, 2
    root = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="aa_"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"A/A: {ns.recipe} as two identical arms, {ns.seeds} seeds each, {ns.campaigns} campaigns per "
        f"design, load shift half-way: {'on' if ns.load_shift else 'off'}; load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    counts: dict[str, list[str]] = {d: [] for d in ns.designs}
    try:
        for i in range(ns.campaigns):
            seeds = list(range(i * ns.seeds, (i + 1) * ns.seeds))
            for design in ns.designs:
                folder = root / f"c{i}_{design}"
                start = time.perf_counter()
                half = ns.seeds  # of 2 x seeds runs
                if ns.load_shift:
                    with LoadShift(folder, half):
                        campaign(folder, design, ns.recipe, seeds, ns.overrides)
                else:
                    campaign(folder, design, ns.recipe, seeds, ns.overrides)
                said, ratio = claim(folder)
                counts[design].append(said)
                print(
                    f"campaign {i + 1}/{ns.campaigns} {design:11s} ({time.perf_counter() - start:.0f} s): "
                    f"time ratio B/A {ratio}: claim {said}",
                    flush=True,
                )
    finally:
        if not ns.out and not ns.keep:
            shutil.rmtree(root, ignore_errors=True)
    for design, claims in counts.items():
        k, n = sum(c != "none" for c in claims), len(claims)
        low, high = clopper_pearson(k, n)
        print(
            f"{design}: false claims {k}/{n} ({100 * k / max(n, 1):.0f} %, 95 % CI "
            f"{100 * low:.0f}-{100 * high:.0f} %)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
