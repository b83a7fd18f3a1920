"""``kfac-bench compare --chain``: a chain's time to solution is the sum of its pretraining phases' training
time (TPDS §6.3.3) and its result the fine-tuning run's final F1; checked on hand-made run directories
(real ``summary.json`` files) against values computed by hand, and the chain's shape and links."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import pytest

from kfac_bench.cli import main as cli_main
from kfac_bench.compare.chain import (
    CHAIN_COLUMNS,
    chain_rows,
    compare_chains,
    load_chain,
    parse_chain,
    render_chains,
)
from kfac_bench.errors import UserError
from kfac_bench.metrics.summary import write_summary

MLM = "kfac_bench.tasks.masked_lm.build_masked_lm"
SQUAD = "kfac_bench.tasks.squad.build_squad_task"


def _run(
    path: Path,
    task: str,
    train_time_s: float,
    *,
    steps: int = 10,
    kfac: bool = False,
    init: str | None = None,
    status: str = "success",
    final: dict[str, float] | None = None,
) -> Path:
    path.mkdir(parents=True)
    summary: dict[str, Any] = {
        "status": status,
        "steps": steps,
        "train_time_s": train_time_s,
        "wall_time_s": train_time_s + 7.0,
        "kfac_enabled": kfac,
        "targets": {"f1": 90.1} if task == SQUAD else {},
        "final_metrics": final,
        "config": {
            "task": {"_target_": task},
            "optimizer": {"name": "adamw" if task == SQUAD else "lamb"},
            "model": {"init_checkpoint": init},
        },
    }
    write_summary(path, summary)
    return path


def _chain(
    root: Path,
    times: tuple[float, float, float],
    f1: float,
    kfac: tuple[bool, bool] = (False, False),
) -> list[Path]:
    p1 = _run(root / "p1", MLM, times[0], steps=7038, kfac=kfac[0])
    p2 = _run(
        root / "p2", MLM, times[1], steps=1563, kfac=kfac[1], init=f"{p1}/checkpoints/last.pt"
    )
    squad = _run(
        root / "squad",
        SQUAD,
        times[2],
        init=f"{p2}/checkpoints/last.pt",
        status="success" if f1 >= 90.1 else "target_not_reached",
        final={"exact_match": f1 - 7.0, "f1": f1},
    )
    return [p1, p2, squad]


def test_time_to_solution_is_the_pretraining_training_time(tmp_path: Path) -> None:
    lamb = load_chain("lamb", _chain(tmp_path / "a", (1000.0, 500.0, 300.0), 90.1))
    kfac = load_chain("kfac", _chain(tmp_path / "b", (900.0, 300.0, 310.0), 89.9, (True, True)))
    rows = chain_rows([lamb, kfac])
    assert [r["time_to_solution_s"] for r in rows] == [1500.0, 1200.0]  # 1000 + 500, 900 + 300
    assert rows[0]["time_ratio"] == 1.0 and rows[1]["time_ratio"] == pytest.approx(1200 / 1500)
    assert [r["finetune_time_s"] for r in rows] == [300.0, 310.0]  # shown, not counted
    assert [r["f1"] for r in rows] == [90.1, 89.9] and rows[1]["exact_match"] == pytest.approx(82.9)
    assert [r["reached"] for r in rows] == [True, False]  # F1 >= 90.1 is the target, inclusive
    assert rows[0]["pretraining"] == "LAMB 7038 + LAMB 1563"
    assert rows[1]["pretraining"] == "K-FAC 7038 + K-FAC 1563"
    assert rows[0]["phase_times_s"] == "1000.0 + 500.0"
    assert [r["status"] for r in rows] == ["finished", "finished"]
    assert lamb.notes == [] and kfac.notes == []
    table = render_chains([lamb, kfac], "terminal")
    assert table.splitlines()[0].startswith("target: SQuAD v1.1 f1 >= 90.1 (baseline: lamb)")
    # K-FAC's time to solution over LAMB's, as compare's table states time (< 1: faster).
    kfac_line = table.splitlines()[3]
    assert kfac_line.startswith("kfac ") and f" {1200 / 1500:.2f} " in kfac_line
    assert "time_ratio = a chain's time to solution / the baseline's" in table.splitlines()[0]
    parsed = list(csv.DictReader(io.StringIO(render_chains([lamb, kfac], "csv"))))
    assert list(parsed[0]) == CHAIN_COLUMNS and parsed[1]["time_to_solution_s"] == "1200.0"


def test_a_stopped_phase_and_a_broken_link_are_reported(tmp_path: Path) -> None:
    p1, _, squad = _chain(tmp_path, (10.0, 20.0, 5.0), 50.0)
    diverged = _run(
        tmp_path / "p2b", MLM, 20.0, status="diverged", init=f"{p1}/checkpoints/last.pt"
    )
    chain = load_chain("x", [p1, diverged, squad])
    assert chain_rows([chain])[0]["status"] == "p2b: diverged"
    # The SQuAD run started from p2, not from the phase 2 given: a note, not an error.
    assert chain.notes == [f"chain 'x': '{squad}' did not start from a checkpoint of '{diverged}'"]
    assert f"note: {chain.notes[0]}" in render_chains([chain], "terminal")


def test_links_are_checked_by_path_or_by_run_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    p1 = _run(Path("runs/p1"), MLM, 1.0)
    p2 = _run(
        Path("runs/p2"), MLM, 1.0, init="runs/p1/checkpoints/last.pt"
    )  # relative, as launched
    moved = _run(Path("runs/sq"), SQUAD, 1.0, init="/old/p2/checkpoints/last.pt", final={"f1": 1.0})
    other = _run(
        Path("runs/sq2"), SQUAD, 1.0, init="/old/p9/checkpoints/last.pt", final={"f1": 1.0}
    )
    # A relative path resolves to the same folder; a run folder moved since is recognised by its name.
    assert load_chain("c", [tmp_path / "runs" / "p1", p2, moved]).notes == []
    assert len(load_chain("c", [p1, p2, other]).notes) == 1


@pytest.mark.parametrize(
    "spec",
    ["lamb", "=a,b", "lamb=a", "lamb=a,,c", "lamb="],
    ids=["no-eq", "no-name", "one", "empty", "none"],
)
def test_bad_specifications_are_one_line(spec: str) -> None:
    with pytest.raises(
        UserError, match="expected --chain NAME=PHASE1_RUN,PHASE2_RUN,SQUAD_RUN"
    ) as info:
        parse_chain(spec)
    assert "\n" not in str(info.value)


def test_parse_keeps_the_order_of_the_runs() -> None:
    assert parse_chain("kfac = r/p1, r/p2 ,r/sq") == (
        "kfac",
        [Path("r/p1"), Path("r/p2"), Path("r/sq")],
    )


def test_wrong_chains_are_refused(tmp_path: Path) -> None:
    p1, p2, squad = _chain(tmp_path, (1.0, 1.0, 1.0), 1.0)
    with pytest.raises(UserError, match="is not a SQuAD fine-tuning run"):
        load_chain("c", [p1, p2])  # no fine-tuning run at the end
    with pytest.raises(UserError, match="is not a BERT pretraining run"):
        load_chain("c", [squad, squad])
    with pytest.raises(UserError, match=r"no summary\.json in"):
        load_chain("c", [p1, tmp_path / "missing", squad])
    with pytest.raises(UserError, match="chain name 'a' is given twice"):
        compare_chains([f"a={p1},{squad}", f"a={p2},{squad}"], tmp_path / "out")


def test_cli_writes_the_tables_and_reports_misuse_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = ",".join(str(p) for p in _chain(tmp_path / "a", (3.0, 4.0, 5.0), 91.0))
    out = tmp_path / "out"
    assert (
        cli_main(["compare", "--chain", f"lamb={runs}", "--out", str(out), "--format", "markdown"])
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        printed.startswith("**target: SQuAD v1.1 f1 >= 90.1")
        and "| lamb | LAMB 7038 + LAMB 1563 |" in printed
    )
    assert (out / "chains.md").read_text() in printed and (out / "chains.csv").is_file()
    for args, problem in (
        (["compare"], "not neither"),
        (["compare", str(tmp_path), "--chain", f"lamb={runs}"], "not both"),
        (["compare", "--chain", "lamb"], "bad chain 'lamb'"),
    ):
        assert cli_main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and err[0].startswith("kfac-bench: error: compare: ")
            and problem in err[0]
        )
