"""Schemas of the image benchmark builders."""

from __future__ import annotations

SCHEMAS: list[tuple[str, str, type]] = []
