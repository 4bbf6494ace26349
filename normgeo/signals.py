"""The process's one owner of its stop signals: SIGINT (Ctrl-C), SIGTERM (``kill``, ``scancel``), SIGHUP
(a closed terminal or SSH session) and SIGUSR1 (in a SLURM job the requeue signal, elsewhere a stop).

An entry point takes them (:meth:`SignalOwner.owning`) and, when it returns, puts back the handlers that were
there (a caller's: a notebook's, a test's, the next job of a ``-m`` sweep). While it owns them, what a stop
signal does is the current phase's to say, the innermost of a stack: :class:`StopAtOnce` before and after
training (one line, exit 128 + the signal; what :func:`corpus.atomic.atomic_open` was writing is dropped
whole), and during training ``callbacks.signal_stop.Interrupt`` (stop at the next optimizer step, abandon a
validation or a probe). Lightning's fit puts its own SIGTERM handler over the owner's and back at its
teardown; the training phase takes the signal back for the fit (:meth:`SignalOwner.reclaim`). SLURM's USR1
goes to :class:`slurm.requeue.SlurmRequeue`: it is taken before train.py's slow imports (Python dies of a USR1
it has no handler for) and kept for the job's life. Standard library only (slurm.requeue is too), so that
train.py can import it first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from slurm.requeue import SlurmRequeue, under_slurm

Phase = Callable[[int, Any], None]  # a signal handler: what a stop signal does in this phase
# Every signal whose default action would kill the run where it stands, without a word or a last.ckpt.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


class StopAtOnce:
    """A phase in which a stop signal ends the process at once with one line and exit 128 + the signal:
    the SystemExit unwinds through ``atomic_open``, which removes its temporary, so nothing half-written
    stays. ``doing``: when it came (``before training started``); ``again``: what to do next."""

    def __init__(self, doing: str, again: str) -> None:
        self.doing, self.again = doing, again

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: the signal may land inside a print to stderr.
        os.write(2, f"{name} {self.doing}: stopped, nothing half-written left; {self.again}\n".encode())
        raise SystemExit(128 + signum)


class FinishFirst:
    """A phase whose work must not be cut in half (a start being undone, the run's folder put back as it was
    found; the session's summary, its account of what it trained): a stop signal is said and kept in
    ``received`` for the caller to act on once that work is done."""

    def __init__(self, doing: str) -> None:
        self.doing = doing
        self.received: int | None = None  # the first signal that came, for the caller to act on after

    def __call__(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        os.write(2, f"{signal.Signals(signum).name} {self.doing}: finishing that first\n".encode())


class Abandoned(Exception):
    """A stop signal in an :class:`AbandonAtOnce` phase; ``signum`` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class AbandonAtOnce:
    """A phase whose work may be dropped but whose caller must first record that it was (the end's figures,
    after the summary): a stop signal raises :class:`Abandoned` where the work stands."""

    def __call__(self, signum: int, frame: Any) -> None:
        raise Abandoned(signum)


class SignalOwner:
    """The handler of this process's stop signals (:data:`OWNER`, the one instance); see the module's doc."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []
        self.held: set[int] = set()  # the signals it handles now
        self.requeue: SlurmRequeue | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGUSR1 and self.requeue is not None:
            self.requeue(signum, frame)
        elif self.phases:
            self.phases[-1](signum, frame)
        elif signum == signal.SIGINT:  # held, no phase: as Python would
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

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
        """In a SLURM job: SIGUSR1 to :class:`~slurm.requeue.SlurmRequeue` for the job's life (once); None
        outside SLURM or off the main thread."""
        if self.requeue is None and under_slurm() and threading.current_thread() is threading.main_thread():
            self.requeue = SlurmRequeue()  # first: a USR1 may come as soon as the owner takes it
            self.take((signal.SIGUSR1,))
        return self.requeue


OWNER = SignalOwner()


def stop_on_signals(doing: str, again: str) -> None:
    """For a command's whole process (compare, report, export, evaluate, analyze, corpus): a stop
    signal ends it at once (:class:`StopAtOnce`), through the owner."""
    OWNER.take(STOP_SIGNALS)
    OWNER.enter(StopAtOnce(doing, again))


def ignore_at_exit() -> None:
    """An entry point's main has returned or raised: its exit code and last line are decided. The stop
    signals are ignored from here on, so that a second Ctrl-C while the interpreter exits (an atexit callback)
    adds no traceback below the last line and a SIGTERM does not turn the exit code into a kill's."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
