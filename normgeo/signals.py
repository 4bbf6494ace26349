"""What a stop signal does, in one table: :data:`TABLE` gives, for every phase of a run (a row) and every stop
signal (a column: SIGINT, SIGTERM, SIGHUP, SIGUSR1, and SLURM's requeue USR1), the action; :data:`OWNER`, the
process's one handler, carries out the row of the phase that decides now (the innermost of a stack). An entry
point takes the signals (:meth:`SignalOwner.owning`) and puts back a caller's handlers when it returns. In a
SLURM job USR1 is taken before train.py's slow imports (Python dies of a USR1 it has no handler for): the
standard library only. tests/test_signal_handlers.py sends each row's signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from slurm.requeue import requeue_slurm_job, under_slurm

# Every signal whose default action would kill the run where it stands, without a word or a last.ckpt.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
SLURM_USR1 = "SIGUSR1 in a SLURM job"  # the requeue signal (--signal=USR1@lead, preemption)
COLUMNS = (*(s.name for s in STOP_SIGNALS), SLURM_USR1)

# The actions.
STOP = "stop at once"  # one line, exit 128 + the signal; atomic_open drops what it was writing, whole
HOLD = "hold"  # said, and kept (``received``) for the phase's owner to act on once its work is done
FINISH_STEP = "finish the step"  # every rank stops after this optimizer step and saves last.ckpt there
ABANDON = "abandon"  # the work (a validation, a probe: it writes nothing) is dropped at once: SignalStop
ABANDON_END = "abandon the end"  # the end's figures are dropped, and the summary says so: Abandoned
REQUEUE = "requeue now"  # scontrol requeue, exit 0: nothing new to save
REQUEUE_AFTER_STEP = "requeue after the step"  # every rank stops after this step, saves last.ckpt, requeues
IGNORE = "ignore"  # the session ends anyway, its last.ckpt written

# The phases, in the order of a run.
BEFORE = "before training (the checks, data preparation, fit's setup)"
UNDO = "a failed start being undone (its folder put back as it was found)"
FIRST_PROBE = "the probe before the session's first optimizer step"
TRAINING = "training"
AGAIN = "training, after a first signal"
VALIDATION = "a validation or a later probe"
ENDING = "fit's teardown and the summary, after the first optimizer step"
FIGURES = "the end's figures, after the summary"
INTERRUPTED_END = "an end interrupted after its summary"
COMMAND = "another command's work (compare, report, export, evaluate, analyze, corpus)"


def row(user: str, slurm: str) -> dict[str, str]:  # user: SIGINT, SIGTERM, SIGHUP, SIGUSR1; slurm: its USR1
    return {**dict.fromkeys(COLUMNS[:-1], user), SLURM_USR1: slurm}


TABLE: dict[str, dict[str, str]] = {
    BEFORE: row(STOP, REQUEUE),
    UNDO: row(HOLD, HOLD),  # half an undo would leave neither folder
    FIRST_PROBE: row(ABANDON, REQUEUE),
    TRAINING: row(FINISH_STEP, REQUEUE_AFTER_STEP),  # a step boundary: a whole step to resume from
    AGAIN: row(STOP, REQUEUE_AFTER_STEP),
    VALIDATION: row(ABANDON, REQUEUE_AFTER_STEP),
    ENDING: row(HOLD, IGNORE),  # the summary is the session's account of what it trained
    FIGURES: row(ABANDON_END, IGNORE),
    INTERRUPTED_END: row(STOP, IGNORE),
    COMMAND: row(STOP, STOP),
}


def say(text: str) -> None:
    os.write(2, (text + "\n").encode())  # not print: the signal may land inside a print to stderr


class Abandoned(BaseException):
    """A stop signal in the end's figures (ABANDON_END); ``signum`` is the signal. A BaseException, as
    KeyboardInterrupt is: raised from a handler, it may land inside any library's ``except Exception``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Phase:
    """A phase of the run, its ``row`` of :data:`TABLE`: ``doing`` says when a signal came (``before training
    started``), ``again`` what to do next. STOP ends the process with one line and exit 128 + the signal (the
    SystemExit unwinds through ``atomic_open``, which removes its temporary); HOLD says it and keeps it in
    ``received`` for the caller to act on once its work is done; ABANDON_END raises :class:`Abandoned`."""

    def __init__(self, row: str, doing: str = "", again: str = "") -> None:
        self.row, self.doing, self.again = row, doing, again
        self.received: int | None = None  # the first signal held, for the caller to act on after

    def act(self, action: str, signum: int) -> None:
        name = signal.Signals(signum).name
        if action == HOLD:
            self.received = self.received or signum
            say(f"{name} {self.doing}: finishing that first")
        elif action == ABANDON_END:
            raise Abandoned(signum)
        else:
            say(f"{name} {self.doing}: stopped, nothing half-written left; {self.again}")
            raise SystemExit(128 + signum)


BEFORE_TRAINING = Phase(BEFORE, "before training started (checks, data preparation)",
                        "nothing was trained; run the same command again")


class FitPhase(Phase):
    """Where training's :class:`Interrupt` does not decide (fit's setup, its teardown, the end's summary):
    before the session's first optimizer step (``kept()`` false) as before training, after it held."""

    def __init__(self, kept: Callable[[], bool]) -> None:  # its row is kept()'s, not a fixed one
        self.doing, self.again, self.received, self.kept = "as training ended", "", None, kept

    @property
    def row(self) -> str:  # type: ignore[override]
        return ENDING if self.kept() else BEFORE

    def act(self, action: str, signum: int) -> None:
        (BEFORE_TRAINING if action == STOP else super()).act(action, signum)


class SignalStop(BaseException):
    """A stop signal abandoned a validation or a probe (ABANDON): ``last.ckpt`` is saved at this step. A
    BaseException: raised from the handler, it landed inside ``inspect.getfullargspec`` in Lightning's
    validation loop, whose ``except Exception`` turned it into a TypeError (exit 1, seen under load)."""


class Interrupt(Phase):
    """Training's phase (rows TRAINING, AGAIN, FIRST_PROBE, VALIDATION): ``StopOnSignal`` polls what it
    recorded. In place of Python's KeyboardInterrupt (Lightning turns it into exit 1 without saving) and
    Lightning's SIGTERM handler (it stops at the next batch without saving)."""

    def __init__(self, continue_command: Callable[[], str] = str) -> None:
        self.received = False
        self.signum: int | None = None  # the signal this rank received first
        self.stopped_at: int | None = None  # the step at which training stopped, on every rank
        self.announce = True  # rank 0 tells the user; the other ranks of a terminal's Ctrl-C stay quiet
        # The command that goes on with the run, asked when printed: the run's folder then decides it.
        self.continue_command = continue_command
        # What runs now that writes nothing and may be dropped at once (a validation, a probe), else None;
        # one process only: ranks that did not receive the signal would wait in a collective.
        self.abandonable: str | None = None
        self.single_process = True
        self.abandoned: str | None = None  # what a signal abandoned
        # A second interrupt's signal: its SystemExit may surface as another exception (AtomicCheckpointIO)
        self.abandoning: int | None = None
        self.trained = False  # whether this session made an optimizer step: else a stop has nothing to save

    @property
    def row(self) -> str:  # type: ignore[override]
        if self.received:
            return AGAIN
        if self.abandonable is not None:
            return VALIDATION if self.trained else FIRST_PROBE
        return TRAINING

    def enter(self, what: str) -> None:
        """From now on a signal abandons ``what`` at once (SignalStop); one already received does it now."""
        if not self.single_process:
            return
        if self.received:  # e.g. the validation Lightning runs when training stops: skipped, not abandoned
            if self.stopped_at is None:
                self.abandoned = what
            raise SignalStop(what)
        self.abandonable = what

    def leave(self) -> None:
        self.abandonable = None

    def act(self, action: str, signum: int) -> None:
        name = signal.Signals(signum).name
        if action == STOP:
            self.tell(f"{name} again: stopping now, without saving the steps since the last last.ckpt; "
                      f"continue with:\n{self.continue_command()}")
            self.abandoning = signum
            raise SystemExit(128 + signum)
        self.received, self.signum = True, signum
        if action == ABANDON:  # a validation or a probe: nothing written yet, nothing to finish
            what, self.abandonable = self.abandonable, None
            self.abandoned = what
            saving = "saving last.ckpt" if self.trained else "nothing trained this session, nothing to save"
            self.tell(f"{name}: abandoning {what}, {saving} ({name} again: stop now)")
            raise SignalStop(what)
        self.tell(f"{name}: finishing this optimizer step, then saving last.ckpt ({name} again: stop now)")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    def tell(self, text: str) -> None:
        if self.announce:
            say(text)


class SlurmRequeue:
    """SLURM's USR1 (``--signal=USR1@lead``, preemption): its actions; ``received``: StopOnSignal polls it."""

    def __init__(self) -> None:
        self.received = False
        self.stopped_at: int | None = None  # the step training stopped at to requeue

    def act(self, action: str) -> None:
        if action == REQUEUE_AFTER_STEP:
            self.received = True
        elif action == REQUEUE:
            print("USR1 before training started: requeueing the job", file=sys.stderr, flush=True)
            # Every rank requeues (a duplicate request fails harmlessly): a rank that exits without it
            # could leave the others waiting in a collective for the rest of the time limit.
            if requeue_slurm_job():
                raise SystemExit(0)
        elif action != IGNORE:  # a row's own action (HOLD, STOP) for the requeue signal
            raise NotImplementedError(action)


class SignalOwner:
    """The handler of this process's stop signals (:data:`OWNER`, the one instance); see the module's doc."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []
        self.held: set[int] = set()  # the signals it handles now
        self.requeue: SlurmRequeue | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        slurm = signum == signal.SIGUSR1 and self.requeue is not None
        if not self.phases and not slurm:  # held, no phase: as Python would
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        phase = self.phases[-1] if self.phases else BEFORE_TRAINING
        action = TABLE[phase.row][SLURM_USR1 if slurm else signal.Signals(signum).name]
        if slurm and action in (REQUEUE, REQUEUE_AFTER_STEP, IGNORE):
            self.requeue.act(action)  # type: ignore[union-attr]
        else:
            phase.act(action, signum)

    def take(self, signums: tuple[int, ...]) -> dict[int, Any]:
        """Handle ``signums`` from now on; the handlers it replaced (none where it handled the signal
        already). Only the main thread can set handlers: elsewhere, nothing."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        replaced = {signum: signal.signal(signum, self) for signum in signums
                    if signal.getsignal(signum) is not self}
        self.held.update(signums)
        return replaced

    def give_back(self, replaced: dict[int, Any]) -> None:
        """Put back what :meth:`take` replaced (a handler not set from Python: the default)."""
        for signum, previous in replaced.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            self.held.discard(signum)

    @contextlib.contextmanager
    def owning(self, phase: Phase) -> Iterator[SignalOwner]:
        """Within the block the stop signals go to the owner, ``phase`` saying what they do (a phase entered
        inside the block ends with it); after it, the handlers that were there are back."""
        replaced = self.take(STOP_SIGNALS)
        depth = len(self.phases)
        self.phases.append(phase)
        try:
            yield self
        finally:
            del self.phases[depth:]
            self.give_back(replaced)

    def enter(self, phase: Phase) -> None:
        """``phase`` decides from now on, until :meth:`leave` (or the end of the :meth:`owning` block)."""
        self.phases.append(phase)

    def leave(self, phase: Phase) -> None:
        if phase in self.phases:
            self.phases.remove(phase)

    @property
    def phase(self) -> Phase | None:
        """The phase that decides now (None: none entered)."""
        return self.phases[-1] if self.phases else None

    def reclaim(self) -> None:
        """Handle again the signals it holds that a library has since taken over (Lightning's fit sets its
        SIGTERM handler, and puts the owner's back at its teardown)."""
        if threading.current_thread() is threading.main_thread():
            for signum in self.held:
                if signal.getsignal(signum) is not self:
                    signal.signal(signum, self)

    def take_requeue(self) -> SlurmRequeue | None:
        """In a SLURM job: SIGUSR1 to :class:`SlurmRequeue` for the job's life (once); None outside SLURM or
        off the main thread."""
        if self.requeue is None and under_slurm() and threading.current_thread() is threading.main_thread():
            self.requeue = SlurmRequeue()  # first: a USR1 may come as soon as the owner takes it
            self.take((signal.SIGUSR1,))
        return self.requeue


OWNER = SignalOwner()


def training_interrupt() -> Interrupt | None:
    """The :class:`Interrupt` that decides what a stop signal does now, if training is the owner's phase."""
    phase = OWNER.phase
    return phase if isinstance(phase, Interrupt) else None


@contextlib.contextmanager
def abandonable(what: str) -> Iterator[None]:
    """``with abandonable("the probe at step 5"):`` a stop signal inside abandons it at once (SignalStop),
    under training's phase (:class:`Interrupt`) only."""
    interrupt = training_interrupt() or Interrupt()  # outside training: one that no signal reaches
    interrupt.enter(what)
    try:
        yield
    finally:
        interrupt.leave()


def stop_on_signals(doing: str, again: str) -> None:
    """For a command's whole process (compare, report, export, evaluate, analyze, corpus): a stop signal ends
    it at once, through the owner."""
    OWNER.take(STOP_SIGNALS)
    OWNER.enter(Phase(COMMAND, doing, again))


def ignore_at_exit() -> None:
    """An entry point's main has returned or raised: its exit code and last line are decided. The stop
    signals are ignored from here on, so that a second Ctrl-C while the interpreter exits (an atexit callback)
    adds no traceback below the last line and a SIGTERM does not turn the exit code into a kill's."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
