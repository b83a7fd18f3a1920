"""Schemas of the benchmark families' builders (model/, dataset/, task/ options beyond the digits default).

Each module lists ``(group, name, dataclass)`` triples in ``SCHEMAS``; :mod:`kfac_bench.config.store`
registers them as ``schema/<group>/<name>`` like the core schemas.
"""

from __future__ import annotations

from . import bert, detection, image

SCHEMAS: list[tuple[str, str, type]] = [*image.SCHEMAS, *detection.SCHEMAS, *bert.SCHEMAS]
