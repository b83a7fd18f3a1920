"""One rule for every command's output folder (docs/operations.md): missing (made) or empty, anything else
refused in one line, status 2, before any work and with what it holds untouched; the files go in by
descriptor, each replaced atomically, never through a link planted at its name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kfac_bench import safe_files
from kfac_bench.cli import main as cli_main
from kfac_bench.compare.report import find_runs, write_outputs
from kfac_bench.errors import UserError
from kfac_bench.safe_files import LinkRefused
from tests.compare.test_arms import curve, make_run
from tests.compare.test_chain import _chain

VICTIM = b"an earlier result\n"


def _pair(root: Path) -> list[Path]:
    _chain(root.parent / "chain", (3.0, 4.0, 5.0), 91.0)  # a BERT chain for compare --chain
    return [
        make_run(root / "sgd", seed=0, curve=curve(4), epoch_s=0.1, step_s=0.02),
        make_run(root / "kfac", seed=0, curve=curve(2), epoch_s=0.1, step_s=0.03, kfac="comm_opt"),
    ]


def _command(kind: str, runs: Path, out: Path) -> list[str]:
    return {
        "compare": ["compare", str(runs), "--out", str(out)],
        "chains": [
            "compare",
            "--chain",
            "a=" + ",".join(str(runs.parent / "chain" / p) for p in ("p1", "p2", "squad")),
            "--out",
            str(out),
        ],
        "plan": ["plan", "+recipe=digits", "plan.world_sizes=[2]", f"plan.out={out}"],
        "demo": ["demo", "--seeds", "0", "--epochs", "1", "--out", str(out)],
        "prepare-bert": ["prepare-bert", "--input", str(runs / "c.txt"), "--output-dir", str(out)],
    }[kind]


@pytest.mark.parametrize("kind", ["compare", "chains", "plan", "demo", "prepare-bert"])
def test_a_folder_holding_anything_is_refused_before_any_work(
    kind: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = tmp_path / "runs"
    _pair(runs)
    out = tmp_path / "out"
    out.mkdir()
    (out / "compare.md").write_bytes(VICTIM)  # an earlier result, or a name a writer would take

    def no_work(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("work started before the output folder was checked")

    for target in (
        "kfac_bench.compare.report.find_runs",
        "kfac_bench.compare.chain.load_chain",
        "kfac_bench.plan.recipe.load_recipe",
        "kfac_bench.commands.demo._configs",
        "kfac_bench.data.bert_prepare.count_documents",
    ):
        monkeypatch.setattr(target, no_work)
    assert cli_main(_command(kind, runs, out)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert str(out) in line and "already holds 1 entry (compare.md)" in line
    assert "new or empty folder" in line
    assert sorted(os.listdir(out)) == ["compare.md"] and (out / "compare.md").read_bytes() == VICTIM


@pytest.mark.parametrize("kind", ["compare", "chains", "plan"])
def test_a_missing_or_empty_folder_takes_the_results(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    _pair(runs)
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new" / "deeper", empty):
        assert cli_main(_command(kind, runs, out)) == 0, capsys.readouterr().err
        assert sorted(os.listdir(out)) and not [n for n in os.listdir(out) if n.endswith(".tmp")]
        # The same command again would overwrite: refused.
        assert cli_main(_command(kind, runs, out)) == 2
    capsys.readouterr()


def test_a_link_planted_in_an_open_output_folder_is_never_written_through(tmp_path: Path) -> None:
    """The demo's case: its folder (holding its runs) is opened once, and compare's files go in by
    descriptor; a link planted meanwhile at a name is refused (compare.md) or replaced, never followed."""
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    out = tmp_path / "demo"
    with safe_files.output_folder(out, "--out demo", "the demo") as folder:
        runs = _pair(out)[-2:]
        (out / "compare.md").symlink_to(victim)
        with pytest.raises(LinkRefused, match=r"compare\.md: it is a symbolic link to"):
            write_outputs(find_runs(runs), folder)
        (out / "compare.md").unlink()
        os.rename(out, tmp_path / "moved")  # the folder moves, and a link takes its name
        out.symlink_to(tmp_path / "elsewhere")
        (tmp_path / "elsewhere").mkdir()
        moved = [tmp_path / "moved" / run.name for run in runs]
        write_outputs(find_runs(moved), folder)
    assert victim.read_bytes() == VICTIM and os.listdir(tmp_path / "elsewhere") == []
    assert {"compare.md", "compare.csv", "compare.png"} <= set(os.listdir(tmp_path / "moved"))


def test_a_file_or_a_path_below_a_file_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_bytes(VICTIM)
    for out, said in ((a_file, "is a file"), (a_file / "sub", "a folder above it is a file")):
        with pytest.raises(UserError, match=said) as info:
            safe_files.output_folder(out, f"--out {out}", "the files")
        assert "\n" not in str(info.value)
    assert a_file.read_bytes() == VICTIM


def _corpus(tmp_path: Path) -> Path:
    from kfac_bench.data.bert_smoke import write_pydoc_corpus

    return write_pydoc_corpus(tmp_path / "corpus" / "c.txt", max_documents=6)


PREPARE = ["--vocab-size", "400", "--vocab-trainer", "frequency", "--dupe-factor", "1"]
PREPARE += ["--max-seq-length", "32", "--max-predictions-per-seq", "5", "--heldout-fraction", "0.4"]


def test_prepare_bert_follows_the_rule_and_overwrite_replaces_only_its_own_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, out = _corpus(tmp_path), tmp_path / "shards"
    args = ["prepare-bert", "--input", str(corpus), "--output-dir", str(out), *PREPARE]
    assert cli_main(args) == 0
    first = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert Path("heldout") in first and Path("vocab.txt") in first
    assert cli_main(args) == 2 and "--overwrite" in capsys.readouterr().err
    assert cli_main([*args, "--overwrite", "--seed", "7"]) == 0  # an earlier preparation: replaced
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == first
    (out / "notes.txt").write_bytes(VICTIM)  # anything else: refused even with --overwrite
    capsys.readouterr()
    assert cli_main([*args, "--overwrite"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").read_bytes() == VICTIM


def test_prepare_bert_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    from kfac_bench.data.bert_prepare import prepare_shards

    corpus = _corpus(tmp_path)
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "part-00000-of-00001.hdf5").write_bytes(VICTIM)
    kwargs: dict[str, object] = {"vocab_size": 400, "vocab_trainer": "frequency", "dupe_factor": 1}
    kwargs.update(max_seq_length=32, max_predictions_per_seq=5)
    # The name a shard was written to before its rename used to be predictable.
    out = tmp_path / "a"
    out.mkdir()
    (out / "part-00000-of-00001.hdf5.tmp").symlink_to(victim_dir / "part-00000-of-00001.hdf5")
    prepare_shards([corpus], out, **kwargs)  # type: ignore[arg-type]
    # A link planted at heldout/ (the shards of another dataset): refused, nothing there touched.
    out = tmp_path / "b"
    out.mkdir()
    (out / "heldout").symlink_to(victim_dir)
    with pytest.raises(LinkRefused, match="heldout: it is a symbolic link"):
        prepare_shards([corpus], out, heldout_fraction=0.4, overwrite=True, **kwargs)  # type: ignore[arg-type]
    assert os.listdir(victim_dir) == ["part-00000-of-00001.hdf5"]
    assert (victim_dir / "part-00000-of-00001.hdf5").read_bytes() == VICTIM
