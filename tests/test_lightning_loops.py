"""callbacks/lightning_loops.py is the only code that reads Lightning's private loop state: these tests run
it on a real Trainer, so a Lightning release that renames ``_should_check_val_fx``, ``_data_fetcher`` or the
validation loop's progress counters fails here, by name, instead of in a run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from callbacks.lightning_loops import settle_abandoned_validation, validation_follows


class Recorder(L.Callback):
    """What validation_follows says after each training batch, and whether a validation then ran."""

    def __init__(self) -> None:
        self.said: list[bool] = []
        self.validated_after: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.said.append(validation_follows(trainer))

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validated_after.append(len(self.said))


def test_validation_follows_agrees_with_the_validations_lightning_runs(tmp_path: Path) -> None:
    recorder = Recorder()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=6,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        accelerator="cpu",
    )
    trainer.fit(BoringModel())
    assert recorder.said == [False, True] * 3
    assert recorder.validated_after == [2, 4, 6]


def test_an_abandoned_validation_is_counted_as_run(tmp_path: Path) -> None:
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(BoringModel())
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    # a validation abandoned after its first batch was ready
    for tracker in (progress.total, progress.current):
        tracker.ready, tracker.started, tracker.processed, tracker.completed = 3, 3, 2, 2
    settle_abandoned_validation(trainer)
    for tracker in (progress.total, progress.current):
        assert (tracker.ready, tracker.started, tracker.processed, tracker.completed) == (3, 3, 3, 3)
