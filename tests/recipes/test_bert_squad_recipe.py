"""BERT-Large on SQuAD v1.1 (the paper's BERT target): the recipe carries the reference's fine-tuning
hyperparameters, and the smoke chain phase 1 -> phase 2 -> SQuAD runs end to end through the real
``kfac-bench`` CLI, its predictions scored by ``kfac-bench squad-eval`` and the chain by
``kfac-bench compare --chain``; bad input stops the CLI with one line and exit status 2.

Expected values are typed from the sources (gpauloski/BERT-PyTorch scripts/run_squad.sh and run_squad.py,
NVIDIA DeepLearningExamples scripts/run_squad.sh, TPDS §6.3.3), never read from the YAML.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from kfac_bench.cli import main as cli_main
from kfac_bench.config.compose import compose_run, instantiate
from kfac_bench.errors import ConfigError
from kfac_bench.models.bert import load_model_state
from kfac_bench.models.bert_qa import build_bert_qa
from kfac_bench.train.optim import lr_factor
from tests.harness.util import run_cli
from tests.recipes.bert_smoke import PHASE1
from tests.recipes.bert_smoke import train_smoke as _train

ENCODER_WEIGHT = re.compile(
    r"bert\.encoder\.layer\.\d+\..*dense\.weight$|self\.(query|key|value)\.weight$"
)


def test_recipe_has_the_reference_fine_tuning_values() -> None:
    cfg = compose_run(["+recipe=bert_large_squad"])
    assert cfg.model._target_.endswith("build_bert_qa") and cfg.model.preset == "large"
    assert cfg.dataset._target_.endswith("load_squad_splits") and cfg.task._target_.endswith(
        "build_squad_task"
    )
    d = cfg.dataset  # run_squad.py: --max_seq_length 384 --doc_stride 128 --max_query_length 64
    assert (d.max_seq_length, d.doc_stride, d.max_query_length, d.lowercase) == (384, 128, 64, True)
    assert Path(d.train_file).name == "train-v1.1.json" and Path(d.dev_file).name == "dev-v1.1.json"
    assert cfg.model.vocab_file == d.vocab_file  # the model checks the data's vocabulary
    assert (cfg.task.n_best_size, cfg.task.max_answer_length) == (20, 30)
    o = cfg.optimizer  # FusedAdam(lr=3e-5), weight decay 0.01 except bias / LayerNorm
    assert str(o.name.value) == "adamw" and o.lr == pytest.approx(3e-5)
    assert list(o.betas) == [0.9, 0.999] and o.eps == 1e-8 and o.weight_decay == 0.01
    assert o.no_decay_bias_and_norm and not o.scale_lr_with_world_size
    # run_squad.sh: 2 epochs, batch 4 on 1 GPU, fp16; GradientClipper(max_grad_norm=1.0). The batch of 4 is
    # the experiment's global batch, kept on any number of ranks.
    t = cfg.train
    assert t.epochs == 2 and t.max_steps is None and t.batch_size == 4 and t.global_batch_size == 4
    assert str(t.precision.value) == "fp16" and t.grad_clip_norm == 1.0
    assert dict(t.targets) == {"f1": 90.1} and not t.stop_at_target  # TPDS §6.3.3, reported
    assert cfg.kfac.enabled is False  # K-FAC is a pretraining method here
    assert compose_run(["+recipe=bert_large_squad", "train.epochs=3"]).train.epochs == 3  # KAISA
    text = (Path(__file__).resolve().parents[2] / "recipes" / "bert_large_squad.yaml").read_text()
    for source in (
        "scripts/run_squad.sh",
        "run_squad.py",
        "KAISA",
        "train.epochs=3",
        "TPDS §6.3.3",
    ):
        assert source in text


def test_lr_schedule_is_the_references_linear_warmup() -> None:
    cfg = compose_run(["+recipe=bert_large_squad"])
    total = 43_798  # 87,599 training questions / 4 x 2 epochs
    f = lr_factor(
        OmegaConf.to_object(cfg.lr_schedule), steps_per_epoch=total // 2, total_steps=total
    )  # type: ignore[arg-type]

    def reference(step: int) -> float:  # src/schedulers.py LinearWarmUpScheduler, warmup 0.1
        progress = step / total
        return progress / 0.1 if progress < 0.1 else max((progress - 1.0) / (0.1 - 1.0), 0.0)

    for step in (0, 1, 2000, 4379, 4380, 4381, 20_000, total - 1, total):
        assert f(step) == pytest.approx(reference(step), abs=1e-12), step


def test_placeholder_checkpoint_stops_with_one_line() -> None:
    cfg = compose_run(["+recipe=bert_large_squad", "model.preset=tiny"])
    with pytest.raises(
        ConfigError, match=r"'PHASE2_RUN_DIR/checkpoints/last.pt' does not exist.*phase-2"
    ):
        instantiate(cfg.model)


def test_smoke_twin_is_the_tiny_model_on_the_pydoc_set() -> None:
    cfg = compose_run(["+recipe=bert_large_squad_smoke"])
    assert cfg.model.preset == "tiny" and cfg.model.init_checkpoint is None
    assert (
        cfg.dataset._target_.endswith("build_squad_pydoc") and cfg.dataset.root != "data/bert_pydoc"
    )
    assert cfg.model.vocab_size == cfg.dataset.vocab_size == 2000  # the smoke shards' vocabulary
    assert cfg.model.vocab_file == f"{cfg.dataset.root}/vocab.txt"
    assert cfg.train.limit_eval_batches is None  # every question is predicted and scored


# ----------------------------------------------------------------------------------------------------------
# The smoke run, and the smoke chain, through the CLI


def _last(run: Path) -> str:
    return str(run / "checkpoints" / "last.pt")


def _summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The SQuAD smoke twin from scratch; its data folder is written by the run itself."""
    root = tmp_path_factory.mktemp("squad_smoke")
    run = _train(root, "run", "bert_large_squad_smoke", f"dataset.root={root / 'squad_pydoc'}")
    return {"root": root, "run": run, "data": root / "squad_pydoc"}


@pytest.mark.slow
def test_squad_smoke_writes_predictions_that_squad_eval_scores_as_the_run(
    smoke: dict[str, Path],
) -> None:
    summary = _summary(smoke["run"])
    # A tiny model after a few steps is far from F1 90.1: the run finishes and says so.
    assert summary["status"] == "target_not_reached" and not summary["kfac_enabled"]
    assert summary["target_metric"] == "f1" and summary["targets"] == {"f1": 90.1}
    assert summary["steps"] == 12 and summary["samples"] == 12 * 16
    final = summary["final_metrics"]
    assert 0.0 <= final["exact_match"] <= final["f1"] <= 100.0
    # The data folder holds the official-format files the run wrote on first use.
    assert {p.name for p in smoke["data"].iterdir()} >= {
        "train-v1.1.json",
        "dev-v1.1.json",
        "vocab.txt",
    }
    predictions = smoke["run"] / "predictions.json"
    dev = smoke["data"] / "dev-v1.1.json"
    result = run_cli("squad-eval", str(dev), str(predictions), cwd=smoke["root"])
    assert result.returncode == 0, result.stderr
    scored = json.loads(result.stdout)
    assert scored == pytest.approx(final, abs=1e-9) and list(scored) == ["exact_match", "f1"]
    # Every development question was answered (nothing reported as unanswered).
    assert "Unanswered" not in result.stderr
    asked = [
        qa["id"]
        for article in json.loads(dev.read_text())["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    assert sorted(json.loads(predictions.read_text())) == sorted(asked)


#: (phase-1 recipe, phase-2 recipe) of the chain's two arms: the LAMB baseline and K-FAC in both phases
#: (TPDS Table 4c). Phase 1 is the shared runs' (tests/recipes/bert_smoke.py).
ARMS = {
    "lamb": (PHASE1["lamb"], "bert_large_pretrain_phase2_lamb_smoke"),
    "kfac": (PHASE1["kfac"], "bert_large_pretrain_phase2_smoke"),
}


@pytest.fixture(scope="module")
def chains(
    bert_phase1: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Path]]:
    """Both arms at smoke size: phase 1 (tests/recipes/bert_smoke.py) -> phase 2 (from phase 1) -> SQuAD
    (from phase 2), sharing the prepared shards and the SQuAD smoke set."""
    root = tmp_path_factory.mktemp("bert_chain")
    runs: dict[str, dict[str, Path]] = {}
    for arm, (_, phase2) in ARMS.items():
        p1 = bert_phase1[arm]
        p2 = _train(
            root,
            f"{arm}-p2",
            phase2,
            f"dataset.root={root / 'shards512'}",
            f"model.init_checkpoint={_last(p1)}",
        )
        squad = _train(
            root,
            f"{arm}-squad",
            "bert_large_squad_smoke",
            f"dataset.root={root / 'squad_pydoc'}",
            f"model.init_checkpoint={_last(p2)}",
        )
        runs[arm] = {"p1": p1, "p2": p2, "squad": squad}
    return runs


@pytest.mark.slow
# The first one builds both chains: six CLI runs, 3-4 minutes on 2 busy cores.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("arm", list(ARMS))
def test_squad_fine_tunes_the_phase2_model(chains: dict[str, dict[str, Path]], arm: str) -> None:
    chain = chains[arm]
    summary = _summary(chain["squad"])
    assert summary["status"] == "target_not_reached" and not summary["kfac_enabled"]
    assert summary["config"]["model"]["init_checkpoint"] == _last(chain["p2"])
    assert _summary(chain["p2"])["config"]["model"]["init_checkpoint"] == _last(chain["p1"])
    assert [_summary(chain[p])["kfac_enabled"] for p in ("p1", "p2")] == [arm == "kfac"] * 2
    # The encoder started from phase 2: a dozen AdamW steps move it a fraction of the way a fresh model of
    # the same seed is from the phase-2 weights.
    phase2 = load_model_state(_last(chain["p2"]))
    squad = load_model_state(_last(chain["squad"]))
    keys = [k for k in squad if ENCODER_WEIGHT.search(k)]
    assert len(keys) == 12
    torch.manual_seed(summary["config"]["train"]["seed"])
    fresh = build_bert_qa("tiny", vocab_size=2000).state_dict()

    def dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float((a[k] - b[k]).double().pow(2).sum()) for k in keys))

    assert dist(squad, phase2) < 0.3 * dist(fresh, phase2)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # builds both chains when run alone
def test_compare_reports_each_chains_f1_and_time_to_solution(
    chains: dict[str, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = [
        f"{arm}=" + ",".join(str(c[k]) for k in ("p1", "p2", "squad")) for arm, c in chains.items()
    ]
    out = tmp_path / "cmp"
    assert (
        cli_main(["compare", *(a for s in specs for a in ("--chain", s)), "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert (
        "time to solution" in printed and "note:" not in printed
    )  # every link of both chains holds
    rows = {r["chain"]: r for r in csv.DictReader((out / "chains.csv").open())}
    assert list(rows) == ["lamb", "kfac"] and (out / "chains.md").is_file()
    for arm, chain in chains.items():
        p1, p2, squad = (_summary(chain[k]) for k in ("p1", "p2", "squad"))
        row = rows[arm]
        # TPDS §6.3.3: time to solution = phase-1 + phase-2 training time; fine-tuning is reported apart.
        assert float(row["time_to_solution_s"]) == pytest.approx(
            p1["train_time_s"] + p2["train_time_s"]
        )
        assert float(row["finetune_time_s"]) == pytest.approx(squad["train_time_s"])
        assert float(row["f1"]) == pytest.approx(squad["final_metrics"]["f1"])
        assert float(row["exact_match"]) == pytest.approx(squad["final_metrics"]["exact_match"])
        assert row["reached"] == "False" and row["status"] == "finished"
    assert rows["lamb"]["pretraining"] == "LAMB 8 + LAMB 4"
    assert rows["kfac"]["pretraining"] == "K-FAC 8 + K-FAC 4"
    base, kfac = (float(rows[a]["time_to_solution_s"]) for a in ("lamb", "kfac"))
    assert float(rows["kfac"]["time_ratio"]) == pytest.approx(kfac / base)


# ----------------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, through the CLI


def _fails_in_one_line(result: Any, *expected: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfac-bench: error: "), result.stderr[-2000:]
    for text in expected:
        assert text in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ({"version": "v2.0", "data": []}, "version is 'v2.0'"),
        ({"version": "1.1", "data": {"title": "not a list"}}, "no 'data' of type list"),
    ],
    ids=["squad2", "shape"],
)
def test_a_bad_squad_file_stops_training(
    smoke: dict[str, Path], tmp_path: Path, content: dict[str, Any], problem: str
) -> None:
    bad = tmp_path / "train.json"
    bad.write_text(json.dumps(content))
    data = smoke["data"]
    result = run_cli(
        "train",
        "+recipe=bert_large_squad",  # the full recipe: the data is read before the model is built
        f"dataset.train_file={bad}",
        f"dataset.dev_file={data / 'dev-v1.1.json'}",
        f"dataset.vocab_file={data / 'vocab.txt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    _fails_in_one_line(result, str(bad), problem)
    result = run_cli("squad-eval", str(bad), str(smoke["run"] / "predictions.json"), cwd=tmp_path)
    _fails_in_one_line(result, problem)


@pytest.mark.slow
def test_a_checkpoint_that_is_not_bert_pretraining_stops_training(
    smoke: dict[str, Path], tmp_path: Path
) -> None:
    resnet = tmp_path / "last.pt"  # a harness checkpoint of another model
    torch.save({"model": torch.nn.Conv2d(3, 8, 3).state_dict(), "step": 3}, resnet)
    result = run_cli(
        "train",
        "+recipe=bert_large_squad_smoke",
        f"dataset.root={smoke['data']}",
        f"model.init_checkpoint={resnet}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    _fails_in_one_line(result, "is not a BERT pretraining checkpoint")


@pytest.mark.slow
def test_predictions_of_unknown_questions_are_refused(
    smoke: dict[str, Path], tmp_path: Path
) -> None:
    predictions = json.loads((smoke["run"] / "predictions.json").read_text())
    bad = tmp_path / "predictions.json"
    bad.write_text(json.dumps({**predictions, "not-a-question": "x"}))
    dev = smoke["data"] / "dev-v1.1.json"
    result = run_cli("squad-eval", str(dev), str(bad), cwd=tmp_path)
    _fails_in_one_line(result, "1 question id(s)", "'not-a-question'")


@pytest.mark.slow
def test_compare_refuses_a_chain_without_a_squad_run_last(
    smoke: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(smoke["run"])
    assert cli_main(["compare", "--chain", f"x={run},{run}"]) == 2  # a SQuAD run in phase 1's place
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a BERT pretraining run" in err[0]
