"""Stopping a run on a signal at a step boundary, as normgeo.signals' table says: :class:`StopOnSignal` stops
every rank after the same optimizer step, and :func:`exit_if_interrupted` prints the resume command.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from callbacks.lightning_loops import settle_abandoned_validation
from normgeo.signals import OWNER, STOP_SIGNALS, Interrupt, SignalStop, SlurmRequeue
from slurm.requeue import REQUEUED

log = logging.getLogger(__name__)


class StopOnSignal(L.Callback):
    """Stops training at the first optimizer-step boundary after a stop signal, on every rank at once: SLURM's
    requeue signal (USR1, ``normgeo.signals.SlurmRequeue``) or the user's interrupt (``Interrupt``).

    Stopping there (rather than saving from inside the signal handler, as Lightning's SLURM handler does)
    makes the resume point a whole optimizer step: no half-accumulated gradients, no half-applied update, and
    no collective that could meet another rank's all-reduce. The checkpoint owner (callbacks.checkpointing)
    asks :meth:`poll` after each step, and :meth:`abandoned`, before it writes ``last.ckpt``."""

    def __init__(self, requeue: SlurmRequeue | None, continue_command: Callable[[], str],
                 last_checkpoint: Path) -> None:
        self.requeue = requeue
        self.last_checkpoint = last_checkpoint  # what the stop saves, named in the resume message
        self.interrupt = Interrupt(continue_command)
        self.session_start_step = 0  # the step this session began at (a resume's checkpoint step)

    @property
    def stopped_by(self) -> str | None:
        """Why this session stopped before its end: "requeue" or "interrupted by SIGINT"; None otherwise."""
        if self.requeue is not None and self.requeue.stopped_at is not None:
            return REQUEUED
        if self.interrupt.stopped_at is not None:
            return f"interrupted by {self.interrupt.name}"
        return None

    @property
    def late_signal(self) -> int | None:
        """A stop signal this session received after its last step's poll (as fit ended: nothing left to
        stop), which the end (callbacks.run) honours; None when there was none or the poll acted on it."""
        interrupt = self.interrupt
        return interrupt.signum if interrupt.received and interrupt.stopped_at is None else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.session_start_step = trainer.global_step
        self.interrupt.announce = trainer.is_global_zero
        self.interrupt.single_process = trainer.world_size == 1

    def install(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Makes ``Interrupt`` the owner's phase on train start, from the first callback (train.py's
        LambdaCallback), so that the step-0 probe (another callback's on_train_start) is covered too."""
        OWNER.reclaim()  # Lightning's fit put its SIGTERM handler over the owner's
        OWNER.enter(self.interrupt)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training or trainer.state.fn == "fit":
            self.interrupt.enter(f"the validation after step {trainer.global_step}")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.interrupt.leave()  # its result is being logged: a signal from now on stops at the next step

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self.interrupt.leave()

    def abandoned(self, trainer: L.Trainer, exception: SignalStop) -> None:
        """A signal abandoned a validation or a probe at this step: count an abandoned validation as run, and
        record the step the session stopped at (before the checkpoint owner saves ``last.ckpt`` there)."""
        if str(exception).startswith("the validation"):
            settle_abandoned_validation(trainer)
        if self.interrupt.stopped_at is None:  # else stopped at a step boundary already, and said so
            self.interrupt.stopped_at = trainer.global_step
            log.warning("interrupt (%s): abandoned %s; saving last.ckpt at step %d", self.interrupt.name,
                        exception, trainer.global_step)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.interrupt.leave()
        OWNER.leave(self.interrupt)

    def poll(self, trainer: L.Trainer, step: int) -> None:
        """After optimizer step ``step``: if any rank received a stop signal, every rank stops here."""
        self.interrupt.trained = True
        if trainer.should_stop or step >= trainer.max_steps:
            return  # the session ends here anyway: last.ckpt is written, nothing left to stop for
        # Ranks receive signals at slightly different times, possibly steps apart (a terminal's Ctrl-C
        # reaches every rank, a kill only one): any rank's signal stops all of them at this same step.
        # One all-reduce of [requeue, *STOP_SIGNALS] summed over the ranks, at the steps the training loop
        # reports (log_every_n_steps: it waits for the device there anyway), not at every step.
        if trainer.world_size > 1 and step % max(trainer.log_every_n_steps, 1):
            return
        interrupt = self.interrupt
        flags = [bool(self.requeue and self.requeue.received),
                 *(interrupt.signum == signum for signum in STOP_SIGNALS)]
        if trainer.world_size > 1:
            total = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
            flags = [n > 0 for n in trainer.strategy.reduce(total, reduce_op="sum").tolist()]
        requeue, *received = flags  # one process: no collective, and no GPU sync per step
        if requeue and self.requeue is not None:
            log.warning("requeue signal: stopping after step %d to save last.ckpt and requeue the job", step)
            self.requeue.stopped_at = step
        elif any(received):
            # Every rank exits with the signal the user sent, whichever rank received it.
            interrupt.signum = STOP_SIGNALS[received.index(True)]
            log.warning("interrupt (%s): stopping after step %d to save last.ckpt", interrupt.name, step)
            interrupt.stopped_at = step
        else:
            return
        trainer.should_stop = True


def exit_if_interrupted(trainer: L.Trainer) -> None:
    """After fit: when an ``Interrupt`` stopped training, tell the user where it stopped and how to
    continue (the resume command is the last line on stderr), then exit 128 + the signal number (rank 0)."""
    stop = next((c for c in trainer.callbacks if isinstance(c, StopOnSignal)), None)
    if stop is None or stop.interrupt.stopped_at is None:
        return
    interrupt = stop.interrupt
    if trainer.is_global_zero:
        # The other ranks' last words must come before the resume command: rank 0 of Lightning's DDP launcher
        # waits (two minutes at most) for their processes, its children, to exit.
        deadline = time.monotonic() + 120.0
        for proc in getattr(trainer.strategy.launcher, "procs", None) or []:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        abandoned = f" (abandoned {interrupt.abandoned})" if interrupt.abandoned else ""
        if interrupt.stopped_at == stop.session_start_step:  # nothing trained, nothing saved (see train.py)
            print(f"interrupted by {interrupt.name} before this session's first optimizer step{abandoned}: "
                  "nothing trained, nothing saved, the run's folder as this session found it; go on with:",
                  file=sys.stderr)
        else:
            print(f"interrupted by {interrupt.name}: stopped after step {interrupt.stopped_at}{abandoned} "
                  f"and saved {stop.last_checkpoint}; continue the run with:", file=sys.stderr)
        print(interrupt.continue_command(), file=sys.stderr, flush=True)
        raise SystemExit(128 + (interrupt.signum or signal.SIGTERM))
    # The other ranks saved with rank 0 and exit 0: Lightning's launcher SIGKILLs every process, rank 0
    # too, as soon as it sees a child exit non-zero, so 130 from rank 1 could turn rank 0's 130 into -9.
    raise SystemExit(0)
