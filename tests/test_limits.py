"""The suite's hang limits: one factor from the environment scales every limit, test markers included."""

from __future__ import annotations

import pytest

from tests.limits import DEFAULT_SCALE, SCALE_ENV, hang_limit, scale


def test_the_factor_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert scale() == DEFAULT_SCALE and hang_limit(10) == 10 * DEFAULT_SCALE
    monkeypatch.setenv(SCALE_ENV, "7.5")
    assert hang_limit(10) == 75.0


@pytest.mark.parametrize("bad", ["fast", "0", "-2"])
def test_a_bad_factor_is_named(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(SCALE_ENV, bad)
    with pytest.raises(ValueError, match=SCALE_ENV):
        scale()


@pytest.mark.timeout(7)
def test_a_test_s_own_timeout_marker_is_scaled(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(hang_limit(7))


def test_the_default_timeout_is_scaled(request: pytest.FixtureRequest) -> None:
    default = float(request.config.getini("timeout"))
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(hang_limit(default))
