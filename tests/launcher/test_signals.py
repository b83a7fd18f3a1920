"""Preemption flags: a signal caught while a rank starts up counts, the handler installed before (submitit's
requeue) gets the signal back once the run has checkpointed, a launcher's flag forwards every signal."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from kfac_bench.launcher import signals
from kfac_bench.launcher.signals import PreemptionFlag, catch_early


@pytest.fixture(autouse=True)
def _restore_handlers() -> Any:
    saved = {sig: signal.getsignal(sig) for sig in signals.SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    signals._early = None


def test_a_signal_during_start_up_is_kept_and_the_original_handler_handed_back() -> None:
    received: list[int] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: received.append(signum))  # e.g. submitit's
    catch_early()
    os.kill(os.getpid(), signal.SIGUSR2)
    flag = PreemptionFlag().install()
    assert flag.signum == signal.SIGUSR2 and received == []  # recorded, not acted on yet
    flag.restore()
    flag.hand_back()
    assert received == [signal.SIGUSR2]


def test_default_handlers_are_not_called_back() -> None:
    flag = PreemptionFlag().install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert flag.signum == signal.SIGTERM
    flag.restore()
    flag.hand_back()  # SIG_DFL is not called: the process lives on
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_launcher_flag_forwards_every_signal_and_keeps_the_first() -> None:
    forwarded: list[int] = []
    flag = PreemptionFlag(forward=forwarded.append).install()
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    flag.restore()
    assert flag.signum == signal.SIGUSR1 and forwarded == [signal.SIGUSR1, signal.SIGTERM]
