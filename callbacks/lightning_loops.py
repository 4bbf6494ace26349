"""The one place that reaches into Lightning's private loop state (``trainer.fit_loop``), for what its public
API does not say. tests/test_lightning_loops.py checks every private name used here on a real Trainer, so a
Lightning release that renames one fails that test rather than a run."""

from __future__ import annotations

import lightning as L


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after this training batch (its own rule, asked, not copied); a
    ``should_stop`` set before (``stop_at_step``, a requeue: both trigger a validation) is seen."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return not epoch_loop.val_loop.skip and epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def settle_abandoned_validation(trainer: L.Trainer) -> None:
    """Count an abandoned validation as run in the loop's progress, before last.ckpt is saved: the resume then
    continues training after its step, as after any validation (its result was not logged; the next one
    comes at the next ``val_every``). Left half-counted, Lightning would take it for a restart in the
    middle of a validation and keep its counters one batch apart ever after."""
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    for tracker in (progress.total, progress.current):
        tracker.started = tracker.processed = tracker.completed = tracker.ready


class ResumedAccumulation(L.Callback):
    """A resume whose accumulation differs from the checkpoint's (``micro_batch`` or the device count
    changed; the global batch is fixed): the training loop's batch counters are restated in this session's
    micro-batches before Lightning restores them. Left in the old unit, the next optimizer step would close
    after the wrong number of micro-batches, mixing two steps' windows, and validations would move."""

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        step = checkpoint.get("global_step", 0)
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = loop.get("epoch_loop.batch_progress")
        if not step or progress is None:
            return
        saved, rest = divmod(progress["total"]["ready"], step)  # the checkpoint's micro-batches per step
        now = trainer.accumulate_grad_batches
        if rest or saved == now:  # saved between optimizer steps (none is), or the same unit
            return
        # The whole run is one epoch (corpus.stream.StepSampler), so the epoch's counters are the run's.
        shift = step * (now - saved)
        for tracker in (progress["total"], progress["current"]):
            for key in ("ready", "started", "processed", "completed"):
                tracker[key] += shift
