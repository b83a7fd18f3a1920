"""What a run directory holds is data, and only the run's: a link planted at any name the run or Hydra writes
is refused when the run starts; undecodable or absurdly nested files give one line or a fallback, never a
traceback; checkpoints without a recorded config are not resumed into another config; a rank whose peer
died mid-collective says so in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kfac_bench.errors import ConfigError, UserError
from kfac_bench.launcher import rundir
from kfac_bench.launcher.distributed import lost_peer
from kfac_bench.metrics.sinks import JsonlSink
from kfac_bench.safe_files import LinkRefused
from tests.harness.util import tiny_cfg


@pytest.mark.parametrize("name", rundir.WRITTEN)
def test_a_link_at_any_name_the_run_writes_is_refused_at_start(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "precious"
    victim.write_bytes(b"mine\n")
    run = tmp_path / "run"
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).symlink_to(victim)
    with pytest.raises(LinkRefused) as info:
        rundir.check_planted(run)
    assert str(info.value).startswith(
        f"refusing to write {run / name}: it is a symbolic link to {victim}"
    )
    assert victim.read_bytes() == b"mine\n"


def test_undecodable_or_nested_run_dir_files_are_one_line(tmp_path: Path) -> None:
    cfg = tiny_cfg()
    (tmp_path / "config.yaml").write_bytes(b"optimizer:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError) as info:
        rundir.check_config(tmp_path, cfg)
    assert str(info.value) == (
        f"cannot read the recorded config {tmp_path / 'config.yaml'} (UnicodeDecodeError); restore it "
        "or choose another hydra.run.dir"
    )
    (tmp_path / "config.yaml").write_text("a: " + "[" * 10_000 + "]" * 10_000 + "\n")
    with pytest.raises(ConfigError, match=r"cannot read the recorded config .*\(RecursionError\)"):
        rundir.check_config(tmp_path, cfg)
    (tmp_path / "diverged").write_bytes(b"step 7: loss \xff\xfe nan\n")
    with pytest.raises(UserError) as diverged:
        rundir.check_not_diverged(tmp_path)
    assert "holds a run that diverged (step 7: loss \ufffd\ufffd nan)" in str(diverged.value)
    assert "\n" not in str(diverged.value)


def test_eval_jsonl_lines_that_are_no_records_are_dropped_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    good = [json.dumps({"step": s, "metrics": {"top1": 0.5}}, sort_keys=True) for s in (3, 6, 9)]
    path.write_bytes(
        (good[0] + "\n").encode()
        + b'{"step": 4, "x": "\xff\xfe"}\n'
        + ("[" * 100_000 + "]" * 100_000 + "\n").encode()
        + (good[1] + "\n" + good[2] + "\n").encode()
    )
    assert JsonlSink(path).truncate_after(6) == 3
    assert path.read_text().splitlines() == good[:2]


def test_checkpoints_without_a_recorded_config_are_not_resumed(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000006.json").write_bytes(b"{}")
    with pytest.raises(ConfigError) as info:
        rundir.check_config(tmp_path, tiny_cfg("optimizer.lr=0.5"))
    assert str(info.value) == (
        f"run dir {tmp_path} holds checkpoints but no config.yaml: the config they were trained with "
        "is unknown, so a resume could mix two configs. Restore "
        f"{tmp_path / 'config.yaml'}, or start the run over with train.resume=false, or choose another "
        "hydra.run.dir"
    )
    rundir.check_config(tmp_path, tiny_cfg("train.resume=false"))  # starting over is fine
    rundir.check_config(tmp_path / "fresh", tiny_cfg())  # and so is a run dir without checkpoints


def test_a_peer_lost_mid_collective_is_told_from_other_errors() -> None:
    # What gloo raised in the surviving rank when rank 0 was SIGKILLed inside a checkpoint save.
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
        "[127.0.0.1]:60135: Connection reset by peer. This is typically caused by a remote worker hanging "
        "or bugs in the application. Check the logs of the remote worker before reporting an error."
    )
    assert lost_peer(gloo) == "Read error [127.0.0.1]:60135: Connection reset by peer"
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert lost_peer(ValueError("Connection reset by peer")) is None
