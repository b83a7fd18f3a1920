"""BERT-Large pretraining recipes: the composed configs carry the paper's numbers, and the smoke
twins train the tiny BERT on real HDF5 shards through the real ``kfac-bench`` CLI (LAMB, K-FAC, and a phase-2
run that starts from a phase-1 checkpoint). ``kfac-bench prepare-bert`` writes shards the reader accepts.

The expected values below are typed from TPDS §6.3.3 (and gpauloski/BERT-PyTorch's phase configs), never
read from the YAML.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from omegaconf import OmegaConf

from kfac_bench.checkpoint.warm_start import locate
from kfac_bench.cli import main as cli_main
from kfac_bench.config.compose import compose_run
from kfac_bench.config.kfac_adapter import build_preconditioner
from kfac_bench.config.store import recipe_names
from kfac_bench.data.batching import accumulation_steps
from kfac_bench.data.bert import BertPretrainingDataset
from kfac_bench.data.bert_corpus import write_pydoc_corpus
from kfac_bench.errors import ConfigError
from kfac_bench.models.bert import BERT_KFAC_SKIP_LAYERS, build_bert, load_model_state
from kfac_bench.train.build import build_data, instantiate
from kfac_bench.train.optim import lr_factor
from tests.harness.util import run_cli
from tests.metrics.mlperf_checker import check as mlperf_check
from tests.metrics.mlperf_checker import events
from tests.recipes.bert_smoke import CLI_QUIET, train_smoke

# TPDS §6.3.3: (sequence length, predictions per sequence, steps, global batch, LR, warm-up).
PHASES = {
    1: (128, 20, 7038, 65536, 6e-3, 0.2843),
    2: (512, 80, 1563, 32768, 4e-3, 0.128),
}
PAPER_GPUS = 16
ENCODER_LINEAR = r"bert\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)$"  # noqa: E501


def _recipe(phase: int, kfac: bool, smoke: bool = False) -> str:
    return (
        f"bert_large_pretrain_phase{phase}"
        + ("" if kfac else "_lamb")
        + ("_smoke" if smoke else "")
    )


def test_all_bert_recipes_exist() -> None:
    names = {_recipe(p, k, s) for p in (1, 2) for k in (True, False) for s in (True, False)}
    assert names <= set(recipe_names())


@pytest.mark.parametrize("phase", [1, 2])
def test_paper_values_of_both_arms(phase: int) -> None:
    seq, preds, steps, global_batch, lr, warmup = PHASES[phase]
    kfac, lamb = (compose_run([f"+recipe={_recipe(phase, arm)}"]) for arm in (True, False))
    for cfg in (kfac, lamb):
        assert cfg.model._target_.endswith("build_bert") and cfg.model.preset == "large"
        assert cfg.dataset._target_.endswith("build_bert_pretraining")
        assert cfg.task._target_.endswith("build_masked_lm")
        t = cfg.train
        assert t.max_steps == steps and t.global_batch_size == global_batch
        # No stop target: the whole step budget runs; the chain's target is SQuAD F1 (bert_large_squad).
        assert dict(t.targets) == {} and not t.stop_at_target
        assert t.eval_every_steps and t.eval_every_steps <= steps // 10  # evaluated every N steps
        # On the paper's 16 GPUs the local batch accumulates to exactly the global batch.
        accum = accumulation_steps(t.batch_size, PAPER_GPUS, global_batch, default=1)
        assert t.batch_size * PAPER_GPUS * accum == global_batch
        assert str(t.precision.value) == "fp16"  # AMP on GPU (ignored on CPU)
        o = cfg.optimizer  # NVIDIA's FusedLAMB settings on timm's Lamb
        assert str(o.name.value) == "lamb" and o.lr == pytest.approx(lr)
        assert list(o.betas) == [0.9, 0.999] and o.eps == 1e-6 and o.weight_decay == 0.01
        assert o.no_decay_bias_and_norm and not o.scale_lr_with_world_size
        s = cfg.lr_schedule
        assert str(s.name.value) == "polynomial" and str(s.unit.value) == "fraction"
        assert s.warmup == pytest.approx(warmup) and s.power == 0.5 and s.warmup_start_factor == 0
    # The two arms differ only in the K-FAC switch (same loop, data order, metrics) and in which arm their
    # tuning record is for.
    a, b = (OmegaConf.to_container(c, resolve=True) for c in (kfac, lamb))
    assert isinstance(a, dict) and isinstance(b, dict)
    assert {k for k in a if a[k] != b[k]} == {"kfac", "name", "tuning"}
    assert (kfac.tuning.arm, lamb.tuning.arm) == ("kfac", "lamb")
    assert lamb.kfac.enabled is False and kfac.kfac.enabled is True
    k = kfac.kfac
    assert k.grad_worker_fraction == "0.5"  # HYBRID-OPT
    assert k.factor_update_steps == 5 and k.inv_update_steps == 50
    assert k.damping == 0.003 and k.factor_decay == 0.95 and k.kl_clip == 0.001
    assert str(k.factor_scaling.value) == "kaisa" and str(k.compute_method.value) == "eigen"
    assert tuple(k.skip_layers) == BERT_KFAC_SKIP_LAYERS
    # The launch comment prepares shards of the phase's sequence length and prediction count.
    text = (
        Path(__file__).resolve().parents[2] / "recipes" / f"{_recipe(phase, True)}.yaml"
    ).read_text()
    assert f"--max-seq-length {seq} --max-predictions-per-seq {preds}" in text
    assert f"kfac-bench train +recipe={_recipe(phase, True)}" in text and "SQuAD" in text


@pytest.mark.parametrize("phase", [1, 2])
def test_lr_schedule_is_nvidias_poly_warmup(phase: int) -> None:
    _, _, steps, _, _, warmup = PHASES[phase]
    cfg = compose_run([f"+recipe={_recipe(phase, True)}"])
    f = lr_factor(
        OmegaConf.to_object(cfg.lr_schedule),  # type: ignore[arg-type]
        steps_per_epoch=10**6,
        total_steps=steps,
    )
    # NVIDIA's PolyWarmUpScheduler: p = t / total; p / warmup during warm-up, then (1 - p) ** 0.5.
    end = math.ceil(warmup * steps)
    for t in (0, 1, end // 2, end - 1):
        assert f(t) == pytest.approx(t / steps / warmup)
    for t in (end, end + 1, steps // 2 + end // 2, steps - 1, steps):
        assert f(t) == pytest.approx((1 - t / steps) ** 0.5)


def test_kfac_arm_preconditions_exactly_the_encoder_linears() -> None:
    cfg = compose_run([f"+recipe={_recipe(1, True)}"])
    model = build_bert("tiny", vocab_size=200)
    precond = build_preconditioner(
        model, cfg.kfac, steps_per_epoch=10, world_size=1, accumulation_steps=1, lr=1e-3
    )
    names = sorted(precond.layers)
    assert len(names) == 2 * 6 and all(re.search(ENCODER_LINEAR, n) for n in names)


# ----------------------------------------------------------------------------------------------------------
# Smoke twins through the real CLI on pydoc shards


@pytest.fixture(scope="module")
def smoke_runs(
    bert_phase1: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Phase-1 smoke runs of both arms (sharing one prepared shard directory; tests/recipes/bert_smoke.py),
    then a phase-2 K-FAC smoke run from the LAMB phase-1 checkpoint (the paper's Table 4(a) pairing)."""
    root = tmp_path_factory.mktemp("bert_smoke")
    runs = dict(bert_phase1)
    runs["phase2"] = train_smoke(
        root,
        "phase2",
        _recipe(2, True, smoke=True),
        f"dataset.root={root / 'shards512'}",
        f"model.init_checkpoint={runs['lamb'] / 'checkpoints' / 'last.pt'}",
        "train.seed=1",
    )
    runs["shards512"] = root / "shards512"
    return runs


def _summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def _evals(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["lamb", "kfac"])
def test_phase1_smoke_trains_on_real_shards(smoke_runs: dict[str, Path], arm: str) -> None:
    summary = _summary(smoke_runs[arm])
    assert summary["status"] == "success" and summary["kfac_enabled"] is (arm == "kfac")
    # Masked-LM accuracy is logged, not a target: a finished run is a success.
    assert summary["target_metric"] == "mlm_accuracy" and summary["targets"] == {}
    assert summary["best_metric"] is not None and not summary["reached_target"]
    assert summary["steps"] == 8 and summary["samples"] == 8 * 16  # global batch 16 = 8 x 2 micro
    assert summary["config"]["optimizer"]["name"] == "lamb"
    if arm == "kfac":
        assert summary["kfac_stage_times_s"] and summary["config"]["kfac"]["inv_update_steps"] > 1
    evals = _evals(smoke_runs[arm])
    assert [e["step"] for e in evals] == [4, 8]  # every N steps
    for e in evals:
        assert 0 <= e["metrics"]["mlm_accuracy"] <= 1 and math.isfinite(e["metrics"]["mlm_loss"])
    # The loss went down from chance level (ln 2000 + ln 2 ~ 8.3) on the held-out shards.
    assert evals[-1]["metrics"]["mlm_loss"] < evals[0]["metrics"]["mlm_loss"] < math.log(2000)
    # The reader fed the run from real NVIDIA-layout shards of the phase's sequence length.
    data = BertPretrainingDataset(smoke_runs["shards128"], shard_by_rank=False)
    assert data.max_seq_length == 128 and data.max_predictions_per_seq == 20 and len(data) > 128
    # MLPerf's BERT log: the compliance checker passes; one run_stop (success): right after the first
    # evaluation that meets the target, at the summary's time to target (without a target: at the end).
    passed, report = mlperf_check(smoke_runs[arm] / "mlperf.log")
    assert passed, report
    log = events(smoke_runs[arm] / "mlperf.log")
    keys = [e["key"] for e in log]
    start, stop = log[keys.index("run_start")], log[-1]
    assert keys.count("run_stop") == 1 and stop["metadata"]["status"] == "success"
    seconds = (stop["time_ms"] - start["time_ms"]) / 1000
    if summary["targets"]:
        reached = [e for e in evals if e["step"] <= summary["steps_to_target"]]
        assert keys[-3:] == ["eval_accuracy", "eval_stop", "run_stop"]
        assert keys.count("eval_accuracy") == len(reached)
        assert seconds == pytest.approx(summary["time_to_target_s"], abs=1.5e-3)
    else:
        assert keys.count("eval_accuracy") == len(evals)
        assert seconds == pytest.approx(summary["wall_time_s"], abs=0.05)


@pytest.mark.slow
def test_both_arms_see_the_same_data_and_differ_only_by_kfac(smoke_runs: dict[str, Path]) -> None:
    lamb, kfac = (_summary(smoke_runs[a])["config"] for a in ("lamb", "kfac"))
    assert {k for k in lamb if lamb[k] != kfac[k]} == {"kfac", "name", "tuning"}  # tuning: its arm
    first = (_evals(smoke_runs[a])[0]["samples"] for a in ("lamb", "kfac"))
    assert len(set(first)) == 1


@pytest.mark.slow
def test_kfac_smoke_on_two_ranks_with_hybrid_opt(
    smoke_runs: dict[str, Path], tmp_path: Path
) -> None:
    # 2 gloo ranks x local batch 4 x 2 accumulation steps = the same global batch of 16; with two ranks
    # grad_worker_fraction 0.5 makes one gradient worker per layer (HYBRID-OPT = MEM-OPT at this size).
    result = run_cli(
        "train",
        f"+recipe={_recipe(1, True, smoke=True)}",
        f"dataset.root={smoke_runs['shards128']}",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "train.device=cpu",
        "train.batch_size=4",
        *CLI_QUIET,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = _summary(tmp_path / "run")
    assert summary["status"] == "success" and summary["world_size"] == 2 and summary["kfac_enabled"]
    assert summary["steps"] == 8 and summary["samples"] == 8 * 16
    assert [e["step"] for e in _evals(tmp_path / "run")] == [4, 8]


@pytest.mark.slow
def test_phase2_starts_from_the_phase1_checkpoint(smoke_runs: dict[str, Path]) -> None:
    summary = _summary(smoke_runs["phase2"])
    assert summary["status"] == "success" and summary["kfac_enabled"]
    cfg = summary["config"]
    assert cfg["model"]["init_checkpoint"].endswith("checkpoints/last.pt")
    # train.init_from follows it: the whole checkpoint, not only the weights, starts phase 2.
    assert cfg["train"]["init_from"] == cfg["model"]["init_checkpoint"]
    assert cfg["dataset"]["max_seq_length"] == 512
    # Table 4(a): LAMB phase 1, K-FAC phase 2: the model and LAMB's moments carried, factors from identity.
    out = (smoke_runs["phase2"] / "stdout.txt").read_text()
    assert (
        "started from" in out and "model, optimizer state, K-FAC factors from the identity" in out
    )
    phase1 = load_model_state(smoke_runs["lamb"] / "checkpoints" / "last.pt")
    phase2 = load_model_state(smoke_runs["phase2"] / "checkpoints" / "last.pt")
    # Phase 2 runs with another seed, so without the checkpoint it would start from another random init.
    torch.manual_seed(cfg["train"]["seed"])
    fresh = build_bert("tiny", vocab_size=cfg["model"]["vocab_size"]).state_dict()
    # The encoder's Linear weights (what K-FAC preconditions; LayerNorm ones and zero biases are the
    # same in every init).
    keys = [k for k in phase1 if re.search(ENCODER_LINEAR.replace("$", r"\.weight$"), k)]
    assert len(keys) == 12

    def dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float((a[k] - b[k]).double().pow(2).sum()) for k in keys))

    norm = math.sqrt(sum(float(phase1[k].double().pow(2).sum()) for k in keys))
    # Four LAMB steps move the weights by a few per cent of their norm; another init is as far as they
    # are long.
    assert dist(phase2, phase1) < 0.15 * norm and dist(fresh, phase1) > 0.7 * norm
    with h5py.File(next(smoke_runs["shards512"].glob("*.hdf5")), "r") as f:
        assert f["input_ids"].shape[1] == 512 and f["masked_lm_positions"].shape[1] == 80
    passed, report = mlperf_check(smoke_runs["phase2"] / "mlperf.log")
    assert passed, report


# ----------------------------------------------------------------------------------------------------------
# kfac-bench prepare-bert


def test_prepare_bert_subcommand_writes_shards_the_recipes_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_pydoc_corpus(tmp_path / "corpus.txt", max_documents=20)
    out = tmp_path / "shards"
    args = ["prepare-bert", "--input", str(corpus), "--output-dir", str(out)]
    options = ["--vocab-size", "500", "--vocab-trainer", "frequency", "--dupe-factor", "1"]
    status = cli_main([*args, *options, "--max-seq-length", "64", "--max-predictions-per-seq", "10",
                       "--heldout-fraction", "0.2", "--num-shards", "2"])  # fmt: skip
    assert status == 0 and "part-00001-of-00002.hdf5" in capsys.readouterr().out
    cfg = compose_run([f"+recipe={_recipe(1, True)}", f"dataset.root={out}"])
    splits = build_data(cfg.dataset)
    assert len(splits.train) > 0 and len(splits.val) > 0
    item = splits.train[0]
    assert item["input_ids"].shape == (64,) and (item["labels"] != -100).sum() >= 1
    # Shards already there: a user error, one line, status 2.
    assert cli_main([*args, *options]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0] and err[0].startswith("kfac-bench: error: ")
    # A bad argument: argparse's report becomes one line with status 2 as well.
    assert cli_main([*args, "--max-seq-length", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid int value: 'many'" in err[0]


@pytest.mark.slow
def test_phase2_refuses_to_start_without_the_phase1_checkpoint(tmp_path: Path) -> None:
    for arm in (True, False):
        cfg = compose_run([f"+recipe={_recipe(2, arm)}", "model.preset=tiny"])
        with pytest.raises(ConfigError, match=r"init_checkpoint 'PHASE1_RUN_DIR/.*phase-1 run"):
            instantiate(cfg.model)
        assert cfg.train.init_from == cfg.model.init_checkpoint
        with pytest.raises(ConfigError, match=r"init_from 'PHASE1_RUN_DIR/.*phase-1 run"):
            locate(cfg.train.init_from)
        phase1 = compose_run([f"+recipe={_recipe(1, arm)}"])
        assert phase1.model.init_checkpoint is None and phase1.train.init_from is None
    # Through the CLI: one line, status 2, before the model or the data is built.
    done = run_cli(
        "train", f"+recipe={_recipe(2, True)}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert "PHASE1_RUN_DIR" in err[0]
