"""Hang limits of the whole suite, in one place.

Every subprocess, rank and wait limit in the tests is ``hang_limit(seconds)``, and every test's own limit
(pytest-timeout, ``timeout`` in pyproject.toml or a ``@pytest.mark.timeout``) is scaled the same way by
``tests/conftest.py``. ``seconds`` is what a calm 2-core machine needs with room to spare; the factor
``KFAC_BENCH_TEST_TIMEOUT_SCALE`` (default 3) stretches it so that a machine running other jobs beside the
suite (a shared CI host, a laptop, a login node: load 3x its cores) still passes while a real hang still
fails, only later. Raise it on a slower machine; no test asserts a wall-clock figure.
"""

from __future__ import annotations

import os

#: The name of the environment variable that scales every limit.
SCALE_ENV = "KFAC_BENCH_TEST_TIMEOUT_SCALE"
DEFAULT_SCALE = 3.0


def scale() -> float:
    """The factor every hang limit is multiplied by (``KFAC_BENCH_TEST_TIMEOUT_SCALE``, default 3)."""
    raw = os.environ.get(SCALE_ENV, "")
    if not raw:
        return DEFAULT_SCALE
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={raw!r} is not a number (e.g. {SCALE_ENV}=5)") from None
    if not value > 0:
        raise ValueError(f"{SCALE_ENV}={raw!r} must be positive")
    return value


def hang_limit(seconds: float) -> float:
    """``seconds`` (enough on a calm machine) stretched to a limit that only a hang exceeds."""
    return seconds * scale()
