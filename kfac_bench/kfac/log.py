"""The engine's logger (``kfac_bench.kfac``) and warnings that are issued once per key."""

from __future__ import annotations

import logging

logger = logging.getLogger("kfac_bench.kfac")


class WarnOnce:
    """Log a warning the first time its key is seen (per preconditioner), never again."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, key: str, msg: str, *args: object) -> None:
        if key not in self.seen:
            self.seen.add(key)
            logger.warning(msg, *args)
