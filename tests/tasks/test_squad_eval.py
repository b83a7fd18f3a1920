"""Official SQuAD v1.1 scoring on hand-made cases (expected values worked out from the definitions of
evaluate-v1.1.py), torchmetrics as a cross-check, and squad-eval's output and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kfac_bench.errors import UserError
from kfac_bench.tasks.squad_eval import (
    exact_match_score,
    f1_score,
    main,
    normalize_answer,
    squad_v11_scores,
)
from tests.data.squad_fixtures import make_smoke, one_article, squad_json, write_json


def test_normalisation() -> None:
    # lower -> drop punctuation ("," "-" "!") -> drop whole-word articles -> collapse whitespace.
    assert normalize_answer("The  Quick, Brown-Fox!") == "quick brownfox"
    # "an" and "the" go only as whole words.
    assert normalize_answer("an Anthem of theirs") == "anthem of theirs"
    assert normalize_answer("A") == ""


def test_f1_and_exact_match_by_hand() -> None:
    # "the cat sat on the mat" -> [cat, sat, on, mat]; "a cat on a mat" -> [cat, on, mat].
    # common = 3, P = 3/4, R = 3/3, F1 = 2 * (3/4) * 1 / (3/4 + 1) = 6/7.
    assert f1_score("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7, abs=1e-15)
    # Repeated tokens count as a multiset: [b, b, c] vs [b, c, c]: common = {b: 1, c: 1} = 2,
    # P = 2/3, R = 2/3, F1 = 2/3.
    assert f1_score("b b c", "b c c") == pytest.approx(2 / 3, abs=1e-15)
    assert f1_score("dog", "cat") == 0.0
    assert exact_match_score("The Denver Broncos.", "denver broncos")
    assert not exact_match_score("Denver", "Denver Broncos")
    # v1.1 rule: no common token -> F1 0, even when both normalise to nothing (the 2.0 script gives 1).
    assert exact_match_score("the", "a") and f1_score("the", "a") == 0.0


def _dataset(tmp_path: Path) -> Path:
    context = "The cat sat on the mat near Denver in 1976."
    qas = [
        {"id": "exact", "question": "?", "answers": [{"text": "Denver", "answer_start": 28}]},
        {
            "id": "partial",
            "question": "?",
            "answers": [
                {"text": "on the mat", "answer_start": 12},
                # Scoring reads only the texts, so a second truth need not be a span here.
                {"text": "a cat on a mat", "answer_start": 0},
            ],
        },
        {"id": "wrong", "question": "?", "answers": [{"text": "1976", "answer_start": 38}]},
        {"id": "unanswered", "question": "?", "answers": [{"text": "cat", "answer_start": 4}]},
    ]
    return write_json(tmp_path / "dev-v1.1.json", squad_json([one_article(context, qas)]))


PREDICTIONS = {"exact": "denver", "partial": "the cat sat on the mat", "wrong": "Denver"}
# exact: EM 1, F1 1. partial: vs "on the mat" -> [on, mat]: common 2, P = 2/4, R = 2/2, F1 = 2/3;
#   vs "a cat on a mat": F1 = 6/7 (above); max = 6/7, EM 0. wrong: 0, 0. unanswered: 0, 0.
# exact_match = 100 * 1 / 4 = 25.0; f1 = 100 * (1 + 6/7) / 4 = 46.428571428571...
EXPECTED = {"exact_match": 25.0, "f1": 100 * (1 + 6 / 7) / 4}


def test_scores_by_hand(tmp_path: Path) -> None:
    truths = {
        "exact": ["Denver"],
        "partial": ["on the mat", "a cat on a mat"],
        "wrong": ["1976"],
        "unanswered": ["cat"],
    }
    scores = squad_v11_scores(truths, PREDICTIONS)
    assert scores["exact_match"] == 25.0
    assert scores["f1"] == pytest.approx(46.42857142857143, abs=1e-12)


def test_squad_eval_prints_the_official_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _dataset(tmp_path)
    preds = write_json(tmp_path / "predictions.json", PREDICTIONS)
    assert main([str(data), str(preds)]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed["exact_match"] == EXPECTED["exact_match"]
    assert printed["f1"] == pytest.approx(EXPECTED["f1"], abs=1e-12)
    assert list(printed) == ["exact_match", "f1"]
    assert err.strip() == "Unanswered question unanswered will receive score 0."


def test_agrees_with_torchmetrics_where_both_follow_v11(tmp_path: Path) -> None:
    torchmetrics_squad = pytest.importorskip("torchmetrics.functional.text").squad
    truths = {
        "exact": ["Denver"],
        "partial": ["on the mat", "a cat on a mat"],
        "wrong": ["1976"],
    }
    preds = [{"id": k, "prediction_text": v} for k, v in PREDICTIONS.items()]
    target = [
        {"id": k, "answers": {"text": v, "answer_start": [0] * len(v)}} for k, v in truths.items()
    ]
    theirs = {k: float(v) for k, v in torchmetrics_squad(preds, target).items()}
    ours = squad_v11_scores(truths, PREDICTIONS)
    assert ours == pytest.approx(theirs, abs=1e-4)  # torchmetrics sums in float32


def test_perfect_predictions_score_100(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    smoke = make_smoke(tmp_path)
    raw = json.loads(smoke.dev.read_text())
    gold = {
        qa["id"]: qa["answers"][-1]["text"]  # any of the ground truths is a perfect answer
        for article in raw["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    }
    preds = write_json(tmp_path / "predictions.json", gold)
    assert main([str(smoke.dev), str(preds)]) == 0
    assert json.loads(capsys.readouterr().out) == {"exact_match": 100.0, "f1": 100.0}


@pytest.mark.parametrize(
    "make_args, problem",
    [
        (lambda d, p: [str(d)], "PRED_FILE"),
        (lambda d, p: [str(d.parent / "missing.json"), str(p)], "missing.json"),
        (lambda d, p: [str(d), str(d.parent / "nothing.json")], "does not exist"),
    ],
)
def test_bad_arguments_give_one_line(tmp_path: Path, make_args, problem: str) -> None:  # type: ignore[no-untyped-def]
    data = _dataset(tmp_path)
    preds = write_json(tmp_path / "predictions.json", PREDICTIONS)
    with pytest.raises(UserError) as info:
        main(make_args(data, preds))
    assert "\n" not in str(info.value) and problem in str(info.value)


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "not valid JSON"),
        (json.dumps(["Denver"]), "holds a JSON list"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (json.dumps({"exact": 1976}), "is a int, not a string"),
        (
            json.dumps({"exact": "Denver", "56be4db0acb8001400a502ec": "x"}),
            "56be4db0acb8001400a502ec",
        ),
    ],
)
def test_bad_prediction_files_give_one_line(tmp_path: Path, content: str, problem: str) -> None:
    data = _dataset(tmp_path)
    preds = tmp_path / "predictions.json"
    preds.write_text(content)
    with pytest.raises(UserError) as info:
        main([str(data), str(preds)])
    assert "\n" not in str(info.value) and problem in str(info.value)
    assert "predictions.json" in str(info.value)


def test_squad2_data_file_gives_one_line(tmp_path: Path) -> None:
    qa = {"id": "q", "question": "?", "answers": [], "is_impossible": True}
    data = write_json(tmp_path / "dev-v2.0.json", squad_json([one_article("x", [qa])], "v2.0"))
    preds = write_json(tmp_path / "p.json", {"q": ""})
    with pytest.raises(UserError) as info:
        main([str(data), str(preds)])
    assert "\n" not in str(info.value) and "dev-v2.0.json" in str(info.value)


def test_deeply_nested_data_file_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kfac_bench.cli import main as cli

    data = tmp_path / "dev-v1.1.json"
    data.write_text('{"version": "1.1", "data": ' + "[" * 100_000 + "]" * 100_000 + "}")
    preds = write_json(tmp_path / "p.json", PREDICTIONS)
    assert cli(["squad-eval", str(data), str(preds)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dev-v1.1.json" in err[0] and "nested too deeply" in err[0], err
