"""A run dir is a boundary, end to end: links planted where the run or Hydra writes are refused before
anything is written, checkpoints the run did not write are never loaded, overwritten or pruned, a resume
without the recorded config is refused, a finished run started again is not rewritten, corrupt run-dir files
fall back, and a rank that loses its peer mid-save says so in one line. Each refusal is one line with exit
status 2 and leaves the victim file (or planted checkpoint) byte-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.harness.fault_util import fault, one_error_line, records, run, snapshot
from tests.harness.util import TINY, run_cli

pytestmark = pytest.mark.slow

VICTIM = b"the job user's own file\n"
#: TINY posing as MLPerf's ResNet benchmark, so that the run writes mlperf.log too.
ARGS = [*TINY, "train.benchmark_name=resnet", "hydra.run.dir=run"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of :data:`ARGS` (2 epochs of 6 steps; checkpoints at steps 6 and 12), to copy."""
    root = tmp_path_factory.mktemp("finished")
    result = run_cli("train", *ARGS, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


def _copy(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir, symlinks=True)
    (run_dir / "run.lock").unlink()
    return run_dir


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "home" / "precious"
    victim.parent.mkdir()
    victim.write_bytes(VICTIM)
    return victim


@pytest.mark.parametrize(
    "name", ["run.lock", ".hydra/config.yaml", ".hydra/overrides.yaml", "summary.json"]
)
def test_a_planted_link_is_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "run" / name
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)
    result = run_cli("train", *TINY, "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 2
    assert one_error_line(result.stderr) == (
        f"kfac-bench: error: refusing to write {link}: it is a symbolic link to {victim}, which the run "
        "did not create; remove it (the run dir may be writable by others: use a private hydra.run.dir)"
    )
    assert victim.read_bytes() == VICTIM and link.is_symlink()
    assert sorted(p.name for p in victim.parent.iterdir()) == ["precious"]
    assert sorted(
        str(p.relative_to(tmp_path / "run")) for p in (tmp_path / "run").rglob("*")
    ) == sorted({name, str(Path(name).parent)} - {"."})  # Hydra wrote nothing either


def test_checkpoints_linked_to_a_shared_folder_are_refused(finished: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shutil.copytree(finished / "checkpoints", shared)
    before = snapshot(shared)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(shared)
    result = run_cli("train", *TINY, "train.resume=false", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        f"refusing to write {tmp_path / 'run' / 'checkpoints'}: it is a symbolic link to {shared}"
        in (one_error_line(result.stderr))
    )
    assert snapshot(shared) == before


@pytest.mark.parametrize("resume", ["true", "false"])
def test_a_checkpoint_copied_in_without_its_manifest_is_refused_and_kept(
    finished: Path, tmp_path: Path, resume: str
) -> None:
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    planted = folder / "step-00000006.pt"  # would be overwritten by the run's first save
    shutil.copy(finished / "checkpoints" / "step-00000012.pt", planted)
    before = planted.read_bytes()
    result = run_cli("train", *TINY, f"train.resume={resume}", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 2
    assert one_error_line(result.stderr) == (
        f"kfac-bench: error: checkpoint {planted} has no manifest, so this run did not write it: it is "
        f"neither loaded nor overwritten. Move it out of {folder} (to start a run from its weights, pass "
        "train.init_from=PATH), then run the same command again"
    )
    assert planted.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == [
        planted.name
    ]
    assert not (tmp_path / "run" / "eval.jsonl").exists()  # refused before any step


def test_a_resume_without_the_recorded_config_is_refused(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    (run_dir / "config.yaml").unlink()
    before = snapshot(run_dir)
    result = run_cli("train", *ARGS, "optimizer.lr=0.5", "train.epochs=3", cwd=tmp_path)
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert f"run dir {run_dir} holds checkpoints but no config.yaml" in line
    assert "train.resume=false" in line
    assert snapshot(run_dir) == before  # the summary still records the config the steps ran with


def test_a_finished_run_started_again_is_not_rewritten(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    before = {k: v for k, v in snapshot(run_dir).items() if not k.startswith(".hydra")}
    assert "mlperf.log" in before
    result = run_cli("train", *ARGS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run dir {run_dir} holds a finished run (step 12): nothing to train" in result.stdout
    after = {k: v for k, v in snapshot(run_dir).items() if not k.startswith(".hydra")}
    assert (
        after == before
    )  # summary.json (wall_time_s), eval.jsonl, mlperf.log, checkpoints as they were


def test_corrupt_run_dir_files_fall_back_on_resume(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    manifest = run_dir / "checkpoints" / "step-00000012.json"
    manifest.write_text(manifest.read_text().replace('"seq": ', '"seq": "abc", "was": '))
    with (run_dir / "eval.jsonl").open("ab") as f:
        f.write(b'{"step": 13, "x": "\xff\xfe"}\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    result = run_cli("train", *ARGS, "train.epochs=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "step-00000012.pt (unreadable manifest)" in warning[0]
    assert "resumed at step 6" in result.stdout and "Traceback" not in result.stderr
    assert [r["step"] for r in records(run_dir)] == [6, 12, 18]
    assert (run_dir / "checkpoints" / "step-00000012.json.corrupt").is_file()


@pytest.mark.distributed
def test_the_survivor_of_a_rank_killed_mid_save_says_so_in_one_line(tmp_path: Path) -> None:
    result = run(
        "train",
        *TINY,
        *fault(tmp_path / "fault", at=4, action="kill_in_save"),
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "launcher.max_restarts=0",
        "launcher.monitor_interval=10",  # the survivor reports before torchrun stops it
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("kfac-bench: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "kfac-bench: error: rank 1 lost another rank mid-collective ("
    )
    assert "Connection" in errors[0] and "Traceback" not in result.stderr
    assert json.loads((tmp_path / "run" / "world.json").read_text())["world_size"] == 2
