"""Schemas of the benchmark families' builders (model/, dataset/, task/ options beyond the digits default).

Each module here lists ``(group, name, dataclass)`` triples in ``SCHEMAS``; :mod:`kfac_bench.config.store`
registers them as ``schema/<group>/<name>`` like the core schemas. Modules are found by listing this package,
so a new family is a new module and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["SCHEMAS"]

SCHEMAS: list[tuple[str, str, type]] = [
    entry
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__))
    for entry in importlib.import_module(f"{__name__}.{module}").SCHEMAS
]
