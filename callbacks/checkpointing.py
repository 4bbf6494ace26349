"""Checkpoints at the paper's schedule (1K, 2K, ... 10K, 20K, ...) plus a resumable ``last.ckpt``.

Both are written through :class:`AtomicCheckpointIO`, so a kill mid-write never leaves a truncated file.
A step that also validates is checkpointed after its validation: a kill during validation then resumes
from the step before and validates again, instead of resuming past a validation that never finished.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.distributed.tensor import DTensor

from callbacks.lightning_loops import settle_abandoned_validation, validation_follows
from corpus.atomic import atomic_open
from models.lit import NonFiniteError
from normgeo.runs.run_config import LAST_CHECKPOINT

log = logging.getLogger(__name__)


class CheckpointSchedule:
    """The optimizer steps at which the experiment's checkpoints (and probes) happen.

    Either an explicit list of steps, or the rule "every ``dense_every`` steps up to ``dense_until``,
    then every ``sparse_every`` steps" (the paper: 1000 / 10000 / 10000), always capped at ``max_steps``
    and always ending with ``max_steps`` itself: the trained model is the one result every run must keep.
    Built from the config's ``checkpoint`` node (``_target_``), which also says how often ``last.ckpt``
    is refreshed and whether scheduled checkpoints keep the optimizer state.

    The rule is never expanded into a list: membership, :meth:`next_step_after` and ``len`` are arithmetic,
    so the memory a schedule takes does not grow with ``max_steps`` (``max_steps=10**12`` is instant).
    Iterating yields the steps in order, one at a time.
    """

    def __init__(
        self,
        max_steps: int,
        steps: Iterable[int] | None = None,
        dense_every: int = 1000,
        dense_until: int = 10000,
        sparse_every: int = 10000,
        last_every: int = 500,
        keep_optimizer: bool = False,
    ) -> None:
        # How often last.ckpt is refreshed and what scheduled checkpoints keep (ScheduledCheckpoint).
        self.last_every = last_every
        self.keep_optimizer = keep_optimizer
        self.max_steps = max_steps
        self.dense_every, self.dense_until, self.sparse_every = dense_every, dense_until, sparse_every
        # An explicit list is as long as the user wrote it: kept sorted, without the steps past the end.
        self.explicit: list[int] | None = None
        if steps is not None:
            chosen = {int(s) for s in steps}
            bad = sorted(s for s in chosen if s <= 0)
            if bad:
                raise ValueError(f"checkpoint steps must be positive, got {bad}")
            self.explicit = sorted(s for s in chosen if s <= max_steps)
        elif min(dense_every, sparse_every) <= 0:
            raise ValueError("checkpoint intervals must be positive")
        if max_steps > 0 and not self.on_rule(max_steps):
            log.info("checkpoint schedule: adding the final step %d (not on the schedule)", max_steps)

    def on_rule(self, step: int) -> bool:
        """Whether ``step`` is on the list or the dense/sparse rule (the final step aside)."""
        if not 0 < step <= self.max_steps:
            return False
        if self.explicit is not None:
            index = bisect.bisect_left(self.explicit, step)
            return index < len(self.explicit) and self.explicit[index] == step
        dense = step <= self.dense_until and step % self.dense_every == 0
        return dense or step % self.sparse_every == 0

    def __contains__(self, step: int) -> bool:
        return step == self.max_steps > 0 or self.on_rule(step)

    def next_step_after(self, step: int) -> int | None:
        """The first scheduled step after ``step``; None after the final step."""
        if step >= self.max_steps or self.max_steps <= 0:
            return None
        step = max(step, 0)
        if self.explicit is not None:
            index = bisect.bisect_right(self.explicit, step)
            return self.explicit[index] if index < len(self.explicit) else self.max_steps
        candidates = [self.max_steps, (step // self.sparse_every + 1) * self.sparse_every]
        dense = (step // self.dense_every + 1) * self.dense_every
        if dense <= self.dense_until:
            candidates.append(dense)
        return min(candidates)

    def __iter__(self) -> Iterator[int]:
        step = self.next_step_after(0)
        while step is not None:
            yield step
            step = self.next_step_after(step)

    def __len__(self) -> int:
        """How many checkpoints the schedule writes, counted without listing them."""
        if self.max_steps <= 0:
            return 0
        if self.explicit is not None:
            return len(self.explicit) + (not self.on_rule(self.max_steps))
        end = self.max_steps
        dense_end = min(self.dense_until, end)
        both = math.lcm(self.dense_every, self.sparse_every)  # steps on both rules, counted once
        count = dense_end // self.dense_every + end // self.sparse_every - dense_end // both
        return count + (not self.on_rule(end))

    @property
    def last(self) -> int | None:
        """The final scheduled step: ``max_steps`` (None for an empty schedule)."""
        return self.max_steps if self.max_steps > 0 else None

    def __repr__(self) -> str:
        rule = (f"steps={self.explicit}" if self.explicit is not None else
                f"dense_every={self.dense_every}, dense_until={self.dense_until}, sparse_every={self.sparse_every}")
        return f"CheckpointSchedule(max_steps={self.max_steps}, {rule})"


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file, fsync, rename: readers see the old checkpoint or the new one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in os.fspath(path):  # remote filesystems (s3://, gs://) keep Lightning's writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        try:
            with atomic_open(os.fspath(path), "wb") as handle:
                torch.save(checkpoint, handle)
        except Exception:
            if Interrupt.abandoning is not None:  # torch.save's C++ writer turned that SystemExit into a RuntimeError
                raise SystemExit(128 + Interrupt.abandoning) from None
            raise


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class OptimizerStepCallback(L.Callback):
    """A callback that acts once per optimizer step, not once per micro-batch (gradient accumulation):
    :meth:`on_optimizer_step` runs on the first batch end after each step. Subclasses that override
    ``on_train_start`` call ``super().on_train_start`` (it records the step a resumed session starts at)."""

    _last_seen_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_seen_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._last_seen_step:
            return  # a micro-batch inside an accumulation window
        self._last_seen_step = trainer.global_step
        self.on_optimizer_step(trainer, pl_module, trainer.global_step)

    def on_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        raise NotImplementedError


class ScheduledCheckpoint(OptimizerStepCallback, Checkpoint):
    """Writes ``step-XXXXXXX.ckpt`` at every scheduled step and refreshes ``last.ckpt`` for resuming.

    Scheduled checkpoints are the experiment's data: by default they keep weights only (no optimizer
    state, about a third of the size); ``last.ckpt`` always keeps everything needed to resume.
    """

    def __init__(self, dirpath: str, schedule: CheckpointSchedule) -> None:
        self.dirpath = Path(dirpath)
        self.schedule = schedule
        self.last_every = schedule.last_every
        self.keep_optimizer = schedule.keep_optimizer
        self._after_validation: int | None = None  # a step whose checkpoints wait for its validation
        self.saved_steps: list[int] = []

    @staticmethod
    def step_path(dirpath: str | Path, step: int) -> Path:
        return Path(dirpath) / f"step-{step:07d}.ckpt"

    def on_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if step not in self.schedule and not (self.last_every and step % self.last_every == 0):
            return
        if validation_follows(trainer):
            self._after_validation = step
            return
        self._save_step(trainer, pl_module, step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._after_validation is not None:
            step, self._after_validation = self._after_validation, None
            self._save_step(trainer, pl_module, step)

    def _save_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        self._check_finite(trainer, pl_module, step)
        if step in self.schedule:
            # Every rank calls save_checkpoint (it is collective under FSDP); rank 0 writes the file.
            trainer.save_checkpoint(self.step_path(self.dirpath, step), weights_only=not self.keep_optimizer)
            self.saved_steps.append(step)
        trainer.save_checkpoint(self.dirpath / LAST_CHECKPOINT, weights_only=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_finite(trainer, pl_module, trainer.global_step)
        trainer.save_checkpoint(self.dirpath / LAST_CHECKPOINT, weights_only=False)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A signal abandoned a validation or a probe: this step's checkpoints now (the scheduled one too,
        which the step's end would have written), so that the resume continues from this step."""
        if isinstance(exception, SignalStop):
            self._after_validation = None
            step = trainer.global_step
            if step in self.schedule and step in self.saved_steps:
                trainer.save_checkpoint(self.dirpath / LAST_CHECKPOINT, weights_only=False)
            else:
                self._save_step(trainer, pl_module, step)

    def _check_finite(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        """Never overwrite a good checkpoint with weights that diverged to inf/NaN."""
        # Each rank checks what it holds (an FSDP2 DTensor's local shard); the decision is all-reduced.
        finite = all(bool(torch.isfinite(_local(p)).all()) for p in pl_module.parameters())
        if not trainer.strategy.reduce_boolean_decision(finite, all=True):
            last = self.dirpath / LAST_CHECKPOINT
            kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was written"
            lr = pl_module.hparams.get("lr", float("nan"))
            raise NonFiniteError(
                f"training diverged: the parameters are not finite after step {step} (stopped without saving; "
                f"{kept}); the likely cause is the learning rate, optim.lr={lr:g}: lower it (e.g. optim.lr={lr / 10:g})",
                step=step, loss=float("nan"), lr=lr)

    def state_dict(self) -> dict[str, Any]:
        return {"saved_steps": list(self.saved_steps)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_steps = list(state_dict.get("saved_steps", []))


class StopAtStep(L.Callback):
    """Ends this session cleanly after optimizer step ``step`` (last.ckpt is written on train end).

    For splitting a long run into chunks that fit a scheduler's time slots: the next session
    continues with ``resume=auto`` exactly where this one stopped.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SignalStop(Exception):
    """A stop signal arrived while this session measured (a validation, a probe): the measurement is
    abandoned at once and ``last.ckpt`` saved at the current optimizer step (:meth:`StopOnSignal.on_exception`,
    :meth:`ScheduledCheckpoint.on_exception`); train.py catches it after fit."""


class RequeueRequest(Protocol):
    """What train.py's USR1 handler records (``slurm.requeue.SlurmRequeue``)."""

    received: bool  # a requeue signal arrived on this rank
    training: bool  # from on_train_start on, the handler only records and StopOnSignal acts
    stopped_at: int | None  # the step at which training stopped so that the job can be requeued


class Interrupt:
    """The user's SIGINT (Ctrl-C) or SIGTERM (``kill``, ``scancel``) while training: recorded, so that
    :class:`StopOnSignal` stops every rank after the current optimizer step and ``last.ckpt`` is saved at
    that step; train.py then prints the resume command and exits 128 + the signal number (130, 143).

    Replaces, from train start on, Python's KeyboardInterrupt (Lightning turns it into exit 1 without
    saving) and Lightning's SIGTERM handler (it stops at the next batch without saving). A second signal
    stops at once: whatever is being written is abandoned (atomic writes keep the previous file).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    # The signal of a second interrupt, process-wide: its SystemExit may surface as another exception
    # (AtomicCheckpointIO re-raises it), whatever was being written is abandoned.
    abandoning: int | None = None
    # The installed one, process-wide: what measures (the probe) marks itself abandonable through it.
    active: Interrupt | None = None

    def __init__(self) -> None:
        self.received = False
        self.signum: int | None = None  # the signal this rank received first
        self.stopped_at: int | None = None  # the step at which training stopped, on every rank
        self.announce = True  # rank 0 tells the user; the other ranks of a terminal's Ctrl-C stay quiet
        self.resume_command = ""
        # What runs now that writes nothing and may be dropped at once (a validation, a probe), else None;
        # one process only: ranks that did not receive the signal would wait in a collective.
        self.abandonable: str | None = None
        self.single_process = True
        self.abandoned: str | None = None  # what a signal abandoned

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

    @classmethod
    @contextlib.contextmanager
    def abandonable_region(cls, what: str) -> Iterator[None]:
        """``with Interrupt.abandonable_region("the probe at step 5"):`` a stop signal inside abandons it
        (no-op when no interrupt handler is installed)."""
        interrupt = cls.active
        if interrupt is None:
            yield
            return
        interrupt.enter(what)
        try:
            yield
        finally:
            interrupt.leave()

    def install(self) -> None:
        Interrupt.abandoning = None
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                signal.signal(signum, self)
            Interrupt.active = self

    def uninstall(self) -> None:
        self.abandonable = None
        if Interrupt.active is self:
            Interrupt.active = None
        for signum in self.SIGNALS:
            if signal.getsignal(signum) is self:  # Lightning's teardown may have restored its own already
                signal.signal(signum, self.DEFAULTS[signum])

    def __call__(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received:
            self.say(f"{name} again: stopping now, without saving the steps since the last last.ckpt; "
                     f"continue with:\n{self.resume_command}")
            Interrupt.abandoning = signum
            raise SystemExit(128 + signum)
        self.received, self.signum = True, signum
        if self.abandonable is not None:  # a validation or a probe: nothing written yet, nothing to finish
            what, self.abandonable = self.abandonable, None
            self.abandoned = what
            self.say(f"{name}: abandoning {what}, saving last.ckpt ({name} again: stop now)")
            raise SignalStop(what)
        self.say(f"{name}: finishing this optimizer step, then saving last.ckpt ({name} again: stop now)")

    def say(self, text: str) -> None:
        if self.announce:
            # os.write, not print: a signal can land while the main thread is inside a print to stderr.
            os.write(2, (text + "\n").encode())


class StopOnSignal(OptimizerStepCallback):
    """Stops training at the first optimizer-step boundary after a stop signal, on every rank at once:
    SLURM's requeue signal (USR1, ``slurm.requeue.SlurmRequeue``) or the user's interrupt (:class:`Interrupt`).

    Stopping there (rather than saving from inside the signal handler, as Lightning's SLURM handler does)
    makes the resume point a whole optimizer step: no half-accumulated gradients, no half-applied
    update, and no collective that could meet another rank's all-reduce. ``last.ckpt`` is then written
    on train end by :class:`ScheduledCheckpoint`; train.py requeues the job, or prints the resume command.
    """

    def __init__(self, requeue: RequeueRequest | None = None, resume_command: str = "") -> None:
        self.requeue = requeue
        self.interrupt = Interrupt()
        self.interrupt.resume_command = resume_command

    @property
    def stopped_by(self) -> str | None:
        """Why this session stopped before its end: "requeue" or "interrupted by SIGINT"; None otherwise."""
        if self.requeue is not None and self.requeue.stopped_at is not None:
            return "requeue"
        if self.interrupt.stopped_at is not None:
            return f"interrupted by {signal.Signals(self.interrupt.signum or signal.SIGTERM).name}"
        return None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.requeue is not None:
            self.requeue.training = True
        self.interrupt.announce = trainer.is_global_zero
        self.interrupt.single_process = trainer.world_size == 1

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training or trainer.state.fn == "fit":
            self.interrupt.enter(f"the validation after step {trainer.global_step}")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.interrupt.leave()  # its result is being logged: a signal from now on stops at the next step

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.interrupt.leave()
        if isinstance(exception, SignalStop):
            step = trainer.global_step
            if str(exception).startswith("the validation"):
                settle_abandoned_validation(trainer)
            if self.interrupt.stopped_at is None:  # else stopped at a step boundary already, and said so
                log.warning("interrupt (%s): abandoned %s; saving last.ckpt at step %d",
                            signal.Signals(self.interrupt.signum or signal.SIGTERM).name, exception, step)
                self.interrupt.stopped_at = step

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.interrupt.uninstall()

    @property
    def installer(self) -> L.Callback:
        """The callback that installs this stop's signal handler: first in the callback list, so that the
        step-0 probe (another callback's on_train_start) is covered too."""
        return InstallInterrupt(self.interrupt)

    def on_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if trainer.should_stop or step >= trainer.max_steps:
            return  # the session ends here anyway: last.ckpt is written, nothing left to stop for
        # Ranks receive signals at slightly different times, possibly steps apart (a terminal's Ctrl-C
        # reaches every rank, a kill only one): any rank's signal stops all of them at this same step.
        # One all-reduce per optimizer step: [requeue, SIGINT, SIGTERM] summed over the ranks.
        interrupt = self.interrupt
        flags = [bool(self.requeue and self.requeue.received), interrupt.signum == signal.SIGINT,
                 interrupt.signum == signal.SIGTERM]
        if trainer.world_size > 1:
            total = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
            flags = [n > 0 for n in trainer.strategy.reduce(total, reduce_op="sum").tolist()]
        requeue, sigint, sigterm = flags  # one process: no collective, and no GPU sync per step
        if requeue and self.requeue is not None:
            log.warning("requeue signal: stopping after step %d to save last.ckpt and requeue the job", step)
            self.requeue.stopped_at = step
        elif sigint or sigterm:
            # Every rank exits with the signal the user sent, whichever rank received it.
            interrupt.signum = signal.SIGINT if sigint else signal.SIGTERM
            log.warning("interrupt (%s): stopping after step %d to save last.ckpt",
                        signal.Signals(interrupt.signum).name, step)
            interrupt.stopped_at = step
        else:
            return
        trainer.should_stop = True


class InstallInterrupt(L.Callback):
    """Installs an :class:`Interrupt` on train start: after Lightning's SIGTERM handler, which fit registers
    before this hook, and before the other callbacks' on_train_start (the step-0 probe)."""

    def __init__(self, interrupt: Interrupt) -> None:
        self.interrupt = interrupt

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.interrupt.install()


def exit_if_interrupted(trainer: L.Trainer) -> None:
    """After fit: when an :class:`Interrupt` stopped training, tell the user where it stopped and how to
    continue (the resume command is the last line on stderr), then exit 128 + the signal number."""
    stop = next((c for c in trainer.callbacks if isinstance(c, StopOnSignal)), None)
    if stop is None or stop.interrupt.stopped_at is None:
        return
    interrupt = stop.interrupt
    signum = interrupt.signum or signal.SIGTERM
    if trainer.is_global_zero:
        wait_for_other_ranks(trainer)  # their last words must come before the resume command
        saved = next((c.dirpath / LAST_CHECKPOINT for c in trainer.callbacks if isinstance(c, ScheduledCheckpoint)), LAST_CHECKPOINT)
        abandoned = f" (abandoned {interrupt.abandoned})" if interrupt.abandoned else ""
        print(f"interrupted by {signal.Signals(signum).name}: stopped after step {interrupt.stopped_at}{abandoned} "
              f"and saved {saved}; continue the run with:", file=sys.stderr)
        print(interrupt.resume_command, file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def wait_for_other_ranks(trainer: L.Trainer, timeout_s: float = 120.0) -> None:
    """Rank 0 of Lightning's DDP launcher waits for the other ranks' processes (its children) to exit."""
    deadline = time.monotonic() + timeout_s
    for proc in getattr(trainer.strategy.launcher, "procs", None) or []:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
