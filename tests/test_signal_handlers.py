"""One owner handles a run's stop signals (normgeo.signals): the start's phase (checks, data preparation), the
training's (callbacks.signal_stop.Interrupt, taken back from Lightning's own handler), the end's (the summary,
figures). A caller's handlers (a notebook's, a test's, a sweep's next job's) are there again when
train.py's main returns. Before: four handlers replaced each other, and the training's stop put back
Python's defaults."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from callbacks.signal_stop import Interrupt
from normgeo.signals import OWNER, STOP_SIGNALS, StopAtOnce
from tests.conftest import train_here


def test_a_training_run_with_data_preparation_and_a_probe_leaves_the_callers_handlers(tmp_path: Path) -> None:
    seen: list[int] = []

    def caller(signum: int, frame: object) -> None:  # never called: the identity is what is checked
        seen.append(signum)

    before = {signum: signal.signal(signum, caller) for signum in STOP_SIGNALS}
    try:
        run_dir = tmp_path / "run"
        train_here(run_dir, "max_steps=2", "checkpoint.steps=[2]")  # prepares tmp_path/data, probes
        assert (tmp_path / "data").is_dir() and (run_dir / "angles.jsonl").stat().st_size > 0
        assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == dict.fromkeys(STOP_SIGNALS, caller)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert seen == []


def test_the_owner_puts_back_what_it_replaced_and_takes_back_what_a_library_set() -> None:
    def outer(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    def library(signum: int, frame: object) -> None:  # stands for Lightning's fit-time SIGTERM handler
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, outer)
    try:
        interrupt = Interrupt()
        with OWNER.owning(StopAtOnce("in the test", "nothing to do")):
            assert signal.getsignal(signal.SIGTERM) is OWNER
            with OWNER.owning(StopAtOnce("nested", "nothing to do")):  # train() inside main(): no new take
                OWNER.enter(interrupt)
                signal.signal(signal.SIGTERM, library)
                OWNER.reclaim()
                assert signal.getsignal(signal.SIGTERM) is OWNER and OWNER.phase is interrupt
            assert signal.getsignal(signal.SIGTERM) is OWNER and isinstance(OWNER.phase, StopAtOnce)
        assert signal.getsignal(signal.SIGTERM) is outer
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_what_a_stop_signal_does_is_the_current_phases(capfd) -> None:
    """Before training: exit 128 + the signal with one line; in training's phase: recorded, the run goes on to
    the step boundary; a second signal: exit at once."""
    interrupt = Interrupt()
    with OWNER.owning(StopAtOnce("before training started", "run it again")):
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.code == 143
        assert "SIGTERM before training started: stopped" in capfd.readouterr().err
        OWNER.enter(interrupt)
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.received and interrupt.signum == signal.SIGINT
        with pytest.raises(SystemExit) as again:
            os.kill(os.getpid(), signal.SIGINT)
        assert again.value.code == 130
    assert OWNER.phase is not interrupt
