"""One source for each default: the harness's K-FAC defaults are the schema's, the engine's are its own,
and docs/engine.md's table lists exactly the options where the two differ, with both values."""

from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from kfac_bench.config.kfac_adapter import HARNESS_ONLY
from kfac_bench.config.schema import KFACConfig
from kfac_bench.kfac import KFACPreconditioner

ROOT = Path(__file__).resolve().parents[2]


def _shown(value: Any) -> str:
    if isinstance(value, Enum):
        value = value.value
    if value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return "none"
    return str(value).lower()


def _schema_defaults() -> dict[str, Any]:
    out = {}
    for f in fields(KFACConfig):
        if f.name in HARNESS_ONLY:
            continue
        out[f.name] = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return out


def _engine_defaults() -> dict[str, Any]:
    params = inspect.signature(KFACPreconditioner.__init__).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def _documented() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "engine.md").read_text()
    text = text[text.index("**Defaults: the engine's and the harness's.**") :]
    text = text[: text.index("\n\n", text.index("| option |"))]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", text, re.MULTILINE)
    return {
        name: (engine.strip().strip("`"), harness.strip().strip("`"))
        for name, engine, harness in rows
    }


def test_the_docs_table_lists_exactly_where_engine_and_harness_defaults_differ() -> None:
    engine, schema = _engine_defaults(), _schema_defaults()
    differ = {
        name: (_shown(engine[name]), _shown(schema[name]))
        for name in schema
        if name in engine and _shown(engine[name]) != _shown(schema[name])
    }
    documented = {k: (e.lower(), h.lower()) for k, (e, h) in _documented().items() if k in schema}
    assert documented == differ


def test_the_strategy_options_set_only_the_strategy() -> None:
    # Every other K-FAC value comes from the schema, so a default has one home.
    for path in sorted((ROOT / "configs" / "kfac").glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text())) - {"defaults"}
        assert keys <= {"grad_worker_fraction", "enabled"}, path.name
