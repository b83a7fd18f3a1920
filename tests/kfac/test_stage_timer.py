"""K-FAC's stage timer costs the device no synchronisation: on CUDA each stage is two events whose time is
read once they completed (without waiting while the run goes on) or when the totals are read. Checked on
the CPU with a stand-in for CUDA's events that records who waited."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from kfac_bench.kfac.timing import Stage, StageTimer


class FakeEvent:
    """A CUDA event on a stream that completes when the test says so."""

    clock = 0.0
    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.done = False

    def record(self) -> None:
        self.at = FakeEvent.clock

    def query(self) -> bool:
        FakeEvent.log.append("query")
        return self.done

    def synchronize(self) -> None:
        FakeEvent.log.append("wait")
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done or end.done, "elapsed_time before the events completed"
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA gives them


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sync(*_: Any) -> None:
        raise AssertionError("the stage timer synchronised the device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.clock, FakeEvent.log = 0.0, []


def test_stages_are_timed_by_events_without_a_device_synchronisation(fake_cuda: None) -> None:
    timer = StageTimer(enabled=True)
    events: list[tuple[FakeEvent, FakeEvent]] = []
    for stage, seconds in ((Stage.FACTOR, 0.5), (Stage.PRECONDITION, 0.25)):
        with timer(stage):
            FakeEvent.clock += seconds
        events.append(timer._pending[-1][1:])  # type: ignore[arg-type]
    # The first stage's events completed meanwhile: the next stage collects them without waiting.
    events[1][1].done = False
    for e in events[0]:
        e.done = True
    with timer(Stage.KL_CLIP):
        FakeEvent.clock += 0.125
    assert "wait" not in FakeEvent.log and len(timer._pending) == 2
    # Reading the totals is the interval boundary: the events still in flight are waited for there.
    totals = timer.seconds
    assert totals["factor"] == pytest.approx(0.5)
    assert totals["precondition"] == pytest.approx(0.25)
    assert totals["kl_clip"] == pytest.approx(0.125)
    assert not timer._pending


def test_off_it_records_nothing(fake_cuda: None) -> None:
    timer = StageTimer(enabled=False)
    with timer(Stage.FACTOR):
        FakeEvent.clock += 1.0
    assert timer.seconds["factor"] == 0.0 and not FakeEvent.log
