"""Fixtures of the recipe tests: the BERT phase-1 smoke runs both BERT files start from
(tests/recipes/bert_smoke.py)."""

from tests.recipes.bert_smoke import bert_phase1

__all__ = ["bert_phase1"]
