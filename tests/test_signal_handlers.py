"""One owner handles a run's stop signals (normgeo.signals), each phase as its table says (one test per row):
the start's (checks, data preparation), training's (Interrupt, taken back from Lightning's own handler), the
end's (the summary, figures). A caller's handlers (a notebook's, a test's, a sweep's next job's) are there
again when train.py's main returns. Before: four handlers replaced each other, and the training's stop put
back Python's defaults."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import normgeo.signals
from normgeo.signals import (
    ABANDON,
    ABANDON_END,
    AGAIN,
    BEFORE,
    COMMAND,
    ENDING,
    FIGURES,
    FINISH_STEP,
    FIRST_PROBE,
    HOLD,
    INTERRUPTED_END,
    OWNER,
    REQUEUE,
    REQUEUE_AFTER_STEP,
    SLURM_USR1,
    STOP,
    STOP_SIGNALS,
    TABLE,
    TRAINING,
    UNDO,
    VALIDATION,
    Abandoned,
    FitPhase,
    Interrupt,
    Phase,
    SignalStop,
    SlurmRequeue,
)
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
        with OWNER.owning(Phase(BEFORE, "in the test", "nothing to do")):
            assert signal.getsignal(signal.SIGTERM) is OWNER
            # train() inside main(): no new take
            with OWNER.owning(Phase(BEFORE, "nested", "nothing to do")):
                OWNER.enter(interrupt)
                signal.signal(signal.SIGTERM, library)
                OWNER.reclaim()
                assert signal.getsignal(signal.SIGTERM) is OWNER and OWNER.phase is interrupt
            assert signal.getsignal(signal.SIGTERM) is OWNER and OWNER.phase.row == BEFORE
        assert signal.getsignal(signal.SIGTERM) is outer
    finally:
        signal.signal(signal.SIGTERM, previous)


def phase_in(row: str) -> Phase:
    """A phase in the state of ``row`` of the table."""
    interrupt = Interrupt()
    if row in (FIRST_PROBE, VALIDATION):
        interrupt.trained = row == VALIDATION
        interrupt.abandonable = "the validation after step 3" if interrupt.trained else "the probe at step 0"
    elif row == AGAIN:
        interrupt.received, interrupt.signum = True, signal.SIGINT
    return {BEFORE: FitPhase(lambda: False), UNDO: Phase(UNDO, "while this start is undone"),
            FIRST_PROBE: interrupt, TRAINING: interrupt, AGAIN: interrupt, VALIDATION: interrupt,
            ENDING: FitPhase(lambda: True), FIGURES: Phase(FIGURES),
            INTERRUPTED_END: Phase(INTERRUPTED_END, "after training", "resume it"),
            COMMAND: Phase(COMMAND, "during the comparison", "run it again")}[row]


@pytest.mark.parametrize("row", list(TABLE))
def test_each_phase_does_what_the_table_says_for_each_signal(row: str, monkeypatch, capfd) -> None:
    """One row of normgeo.signals.TABLE: each stop signal sent to this process, in that phase (SLURM's USR1
    with the job's requeue taken), does the row's action."""
    requeued: list[bool] = []
    monkeypatch.setattr(normgeo.signals, "requeue_slurm_job", lambda: requeued.append(True) or True)
    for column, action in TABLE[row].items():
        phase, requeue = phase_in(row), SlurmRequeue()
        assert phase.row == row
        slurm = column == SLURM_USR1
        signum = signal.SIGUSR1 if slurm else signal.Signals[column]
        monkeypatch.setattr(OWNER, "requeue", requeue if slurm else None)
        raised: BaseException | None = None
        with OWNER.owning(phase):
            try:
                os.kill(os.getpid(), signum)
            except (SystemExit, SignalStop, Abandoned) as err:
                raised = err
        expected = {STOP: (SystemExit, 128 + signum), REQUEUE: (SystemExit, 0), ABANDON: (SignalStop, None),
                    ABANDON_END: (Abandoned, None)}.get(action)
        said = f"{row} / {column}: {action}, raised {raised!r}"
        assert (type(raised), getattr(raised, "code", None)) == (expected or (type(None), None)), said
        assert requeued == ([True] if action == REQUEUE else []), said
        assert requeue.received == (action == REQUEUE_AFTER_STEP), said
        if action == HOLD:
            assert phase.received == signum, said
        if action in (FINISH_STEP, ABANDON):
            assert phase.received and phase.signum == signum, said
        requeued.clear()
    capfd.readouterr()
