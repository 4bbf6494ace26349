"""The base of the callbacks that act once per optimizer step (the checkpoints, the probe)."""

from __future__ import annotations

import lightning as L


class OptimizerStepCallback(L.Callback):
    """A callback that acts once per optimizer step, not once per micro-batch (gradient accumulation):
    :meth:`on_optimizer_step` runs on the first batch end after each step. Subclasses that override
    ``on_train_start`` call ``super().on_train_start`` (it records the step a resumed session starts at)."""

    _last_seen_step = -1
    session_start_step = 0  # the step this session began at: the checkpoint's when resuming

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_seen_step = self.session_start_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._last_seen_step:
            return  # a micro-batch inside an accumulation window
        self._last_seen_step = trainer.global_step
        self.on_optimizer_step(trainer, pl_module, trainer.global_step)

    def on_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        raise NotImplementedError
