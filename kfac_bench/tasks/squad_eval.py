"""SQuAD v1.1 scoring, exactly as the official ``evaluate-v1.1.py``, and ``kfac-bench squad-eval``.

Definitions of the official script (Rajpurkar et al., SQuAD v1.1, ``evaluate-v1.1.py``):

* an answer is normalised by lower-casing, removing ASCII punctuation (``string.punctuation``), removing the
  articles a/an/the (whole words) and collapsing whitespace;
* exact match is 1 when the normalised prediction equals a normalised ground truth;
* F1 is token-level over the normalised whitespace tokens: with ``common`` the multiset intersection,
  0 when it is empty, else 2PR / (P + R) for P = common / predicted tokens, R = common / truth tokens;
* each question takes the best score over its ground truths; a question without a prediction scores 0
  (the script prints "Unanswered question ID will receive score 0." to stderr);
* the results are 100 x the mean over all questions of the data file, summed as Python floats.

torchmetrics' SQuAD metric (``torchmetrics.functional.text.squad``) differs in two places, so it is
used only as a cross-check in the tests: its F1 follows the SQuAD 2.0 script when a normalised answer is
empty (1 if both are empty, where v1.1 gives 0), and it sums in float32 tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import string
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from kfac_bench.data.squad import read_squad
from kfac_bench.errors import ConfigError, UserError

__all__ = [
    "exact_match_score",
    "f1_score",
    "main",
    "normalize_answer",
    "read_predictions",
    "squad_eval_files",
    "squad_v11_scores",
]

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace (in that order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 of the normalised answers; 0 when they share no token (also when one is empty)."""
    predicted = normalize_answer(prediction).split()
    truth = normalize_answer(ground_truth).split()
    num_same = sum((Counter(predicted) & Counter(truth)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(predicted)
    recall = num_same / len(truth)
    return 2 * precision * recall / (precision + recall)


def squad_v11_scores(
    ground_truths: Mapping[str, Sequence[str]], predictions: Mapping[str, str]
) -> dict[str, float]:
    """``{"exact_match", "f1"}`` in percent over every question of ``ground_truths``.

    Args:
        ground_truths: question id -> its answer texts (in data-file order).
        predictions: question id -> predicted answer text; ids not in ``ground_truths`` are ignored here
            (:func:`squad_eval_files` rejects them) and questions without a prediction score 0.
    """
    exact = f1 = 0.0
    for qid, truths in ground_truths.items():
        if qid not in predictions:
            continue
        prediction = predictions[qid]
        exact += max(exact_match_score(prediction, t) for t in truths)
        f1 += max(f1_score(prediction, t) for t in truths)
    total = len(ground_truths)
    if total == 0:
        raise UserError("there are no questions to score")
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def read_predictions(path: str | os.PathLike[str]) -> dict[str, str]:
    """A prediction file: one JSON object mapping question ids to answer strings.

    Raises:
        UserError: a missing file, invalid or too deeply nested JSON, or not an object of strings.
    """
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prediction file '{file}' does not exist")
    try:
        with open(file, encoding="utf-8") as f:
            predictions = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"prediction file '{file}' is not valid JSON ({err})") from None
    except RecursionError:
        raise UserError(
            f"prediction file '{file}' is nested too deeply to read: expected one JSON object mapping "
            "question ids to answer strings"
        ) from None
    if not isinstance(predictions, dict):
        raise UserError(
            f"prediction file '{file}' holds a JSON {type(predictions).__name__}: expected an object "
            'mapping question ids to answer strings ({"56be4db0acb8001400a502ec": "Denver Broncos", ...})'
        )
    wrong = next((k for k, v in predictions.items() if not isinstance(v, str)), None)
    if wrong is not None:
        raise UserError(
            f"prediction file '{file}': the answer of question {wrong!r} is a "
            f"{type(predictions[wrong]).__name__}, not a string"
        )
    return predictions


def squad_eval_files(
    data_file: str | os.PathLike[str], pred_file: str | os.PathLike[str]
) -> tuple[dict[str, float], list[str]]:
    """Scores of a prediction file against a SQuAD v1.1 data file, and the unanswered question ids.

    Raises:
        DatasetError: the data file is missing or not SQuAD v1.1 (see
            :func:`kfac_bench.data.squad.read_squad`).
        UserError: a bad prediction file, or predictions for ids the data file does not hold.
    """
    examples = read_squad(data_file)
    predictions = read_predictions(pred_file)
    truths = {e.id: [a.text for a in e.answers] for e in examples}
    unknown = [qid for qid in predictions if qid not in truths]
    if unknown:
        raise UserError(
            f"prediction file '{pred_file}' answers {len(unknown)} question id(s) that '{data_file}' does "
            f"not hold (first: {unknown[0]!r}): score it against the data file it was predicted for"
        )
    unanswered = [qid for qid in truths if qid not in predictions]
    return squad_v11_scores(truths, predictions), unanswered


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(
            f"squad-eval: {message} (usage: kfac-bench squad-eval DATA_FILE PRED_FILE)"
        )


def main(argv: Sequence[str]) -> int:
    """``kfac-bench squad-eval DATA_FILE PRED_FILE``: print ``{"exact_match": ..., "f1": ...}``.

    As the official script, each unanswered question is reported on stderr and scores 0.
    """
    parser = _Parser(
        prog="kfac-bench squad-eval",
        description="Score SQuAD v1.1 predictions with the official exact-match and F1 definitions.",
    )
    parser.add_argument("data_file", help="the SQuAD v1.1 file, e.g. dev-v1.1.json")
    parser.add_argument("pred_file", help="a JSON object mapping question ids to answer strings")
    args = parser.parse_args(list(argv))
    scores, unanswered = squad_eval_files(args.data_file, args.pred_file)
    for qid in unanswered:
        print(f"Unanswered question {qid} will receive score 0.", file=sys.stderr)
    print(json.dumps(scores))
    return 0
