"""Checkpoints at the paper's schedule (1K, 2K, ... 10K, 20K, ...) plus a resumable ``last.ckpt``, refreshed
every ``last_every`` steps and, with ``every_minutes``, every that many minutes of wall time.

:class:`CheckpointSchedule` is the schedule (also the probe's); :class:`ScheduledCheckpoint` is the one owner
of what is saved when (a new trigger is one branch in its ``on_optimizer_step``). A step that also validates
is checkpointed after its validation: a kill during validation then resumes from the step before and
validates again, instead of resuming past a validation that never finished."""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from callbacks.lightning_loops import validation_follows
from callbacks.optimizer_step import OptimizerStepCallback
from callbacks.signal_stop import StopOnSignal
from corpus.atomic import atomic_open
from normgeo.run_folder import LAST_CHECKPOINT, checkpoint_name
from normgeo.signals import SignalStop, training_interrupt

log = logging.getLogger(__name__)


class CheckpointSchedule:
    """The optimizer steps at which the experiment's checkpoints (and probes) happen: an explicit list, or
    "every ``dense_every`` steps up to ``dense_until``, then every ``sparse_every``" (the paper: 1000 /
    10000 / 10000), capped at ``max_steps`` and always ending with it: the trained model is the one result
    every run must keep. The rule is never expanded into a list (membership, :meth:`next_step_after` and
    ``len`` are arithmetic), so ``max_steps=10**12`` is instant."""

    def __init__(self, max_steps: int, *, steps: Iterable[int] | None, dense_every: int, dense_until: int,
                 sparse_every: int, last_every: int, keep_optimizer: bool,
                 every_minutes: float | None) -> None:
        # How often last.ckpt is refreshed and what scheduled checkpoints keep (ScheduledCheckpoint).
        self.last_every, self.every_minutes, self.keep_optimizer = last_every, every_minutes, keep_optimizer
        self.max_steps = max_steps
        self.dense_every, self.dense_until, self.sparse_every = dense_every, dense_until, sparse_every
        # An explicit list, sorted, without the steps past the end; all positive (CheckpointSchema checks).
        self.explicit = None if steps is None else sorted({int(s) for s in steps if s <= max_steps})
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
        dense = (step // self.dense_every + 1) * self.dense_every
        sparse = (step // self.sparse_every + 1) * self.sparse_every
        return min(self.max_steps, sparse, dense if dense <= self.dense_until else sparse)

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


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file, fsync, rename: readers see the old checkpoint or the new one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        try:  # a local folder (check_writable_folder): no s3:// path here
            with atomic_open(os.fspath(path), "wb") as handle:
                torch.save(checkpoint, handle)
        except Exception:
            interrupt = training_interrupt()
            if interrupt is not None and interrupt.abandoning is not None:  # torch.save's C++ writer turned
                raise SystemExit(128 + interrupt.abandoning) from None  # that SystemExit into a RuntimeError
            raise


class ScheduledCheckpoint(OptimizerStepCallback, Checkpoint):
    """Writes ``step-XXXXXXX.ckpt`` at every scheduled step (weights only by default, about a third of the
    size) and refreshes ``last.ckpt`` (everything needed to resume); ends the session at ``stop_at_step`` or
    on a stop signal (``signal_stop``), saving ``last.ckpt`` there. Lightning runs Checkpoint callbacks after
    the others: this step's probe has measured when this one decides."""

    def __init__(self, dirpath: str, schedule: CheckpointSchedule, *, stop_at_step: int | None = None,
                 signal_stop: StopOnSignal | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dirpath = Path(dirpath)
        self.schedule = schedule  # also says how often last.ckpt is refreshed and what scheduled ones keep
        self.stop_at_step = stop_at_step
        self.signal_stop = signal_stop
        self._after_validation: int | None = None  # a step whose checkpoints wait for its validation
        self._last_saved_at: int | None = None  # the step of this session's newest last.ckpt
        self.clock = clock
        self._last_saved_time = clock()  # when this session's newest last.ckpt was written (or it started)
        self.saved_steps: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # the step this session starts at
        self._last_saved_time = self.clock()

    def on_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        # Whether the session ends after this step: its last.ckpt is then written on train end.
        if self.stop_at_step is not None and step >= self.stop_at_step:
            trainer.should_stop = True
        elif self.signal_stop is not None:
            self.signal_stop.poll(trainer, step)
        last_every, minutes = self.schedule.last_every, self.schedule.every_minutes
        due = step in self.schedule or (last_every and step % last_every == 0)
        if not due and minutes is not None:  # rank 0's clock: all save at one step (collective under FSDP)
            due = trainer.strategy.broadcast(self.clock() - self._last_saved_time >= 60 * minutes, src=0)
        if not due:
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
            trainer.save_checkpoint(self.dirpath / checkpoint_name(step),
                                    weights_only=not self.schedule.keep_optimizer)
            self.saved_steps.append(step)
        self._save_last(trainer)

    def _save_last(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(self.dirpath / LAST_CHECKPOINT, weights_only=False)
        self._last_saved_at = trainer.global_step
        self._last_saved_time = self.clock()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_saved_at == trainer.global_step:
            return  # the final (or stopping) step's last.ckpt is written already (a 1b run's is 12 GB)
        self._check_finite(trainer, pl_module, trainer.global_step)
        self._save_last(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        """A signal abandoned a validation or a probe: this step's checkpoints now (the scheduled one too,
        which the step's end would have written), so that the resume continues from this step."""
        if isinstance(exception, SignalStop):
            if self.signal_stop is not None:
                self.signal_stop.abandoned(trainer, exception)
            self._after_validation = None
            step = trainer.global_step
            if step == self.session_start_step:
                return  # this session trained nothing: nothing to save (train.py undoes its start)
            if step in self.schedule and step in self.saved_steps:
                self._save_last(trainer)
            else:
                self._save_step(trainer, pl_module, step)

    def _check_finite(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        """Never overwrite a good checkpoint with weights that diverged (models.divergence)."""
        last = self.dirpath / LAST_CHECKPOINT
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was written"
        pl_module.divergence.check_weights(pl_module.parameters(), trainer.strategy, step, kept)

    def state_dict(self) -> dict[str, Any]:
        return {"saved_steps": list(self.saved_steps)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_steps = list(state_dict.get("saved_steps", []))
