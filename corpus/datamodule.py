"""Lightning data module: prepare once per node, then serve the deterministic batch stream."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from corpus.prepare import PreparedData, PreparedDataError, load_prepared, prepare
from corpus.stream import ShardSampler, StepSampler, TokenWindows

log = logging.getLogger(__name__)


class TokenDataModule(L.LightningDataModule):
    """The data keys (normgeo.config.schema.DataSchema, their defaults there) with the run's batch geometry
    (normgeo.runs.build.make_datamodule)."""

    def __init__(self, *, name: str, source, directory: str, seq_len: int, global_batch: int,
                 micro_batch: int, max_steps: int, seed: int, tokenizer: str, val_fraction: float,
                 val_sequences: int, val_seed: int | None, auto_prepare: bool, num_workers: int,
                 prepare_command: str) -> None:
        super().__init__()
        self.name = name
        self.source = source
        self.directory = Path(directory)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.max_steps = max_steps
        self.seed = seed
        self.tokenizer = tokenizer
        self.val_fraction = val_fraction
        self.val_sequences = val_sequences
        self.val_seed = seed if val_seed is None else val_seed  # one draw for every arm and seed when given
        self.auto_prepare = auto_prepare
        self.num_workers = num_workers
        self.prepare_command = prepare_command or f"python -m corpus data={name}"
        self.data: PreparedData | None = None

    def prepare_data(self) -> None:
        """Runs on one process per node (Lightning's rule); the others wait at a barrier."""
        if self.auto_prepare:
            prepare(self.source, self.directory, tokenizer=self.tokenizer, val_fraction=self.val_fraction,
                    prepare_hint=self.prepare_command)
        else:
            self.load()

    def load(self) -> PreparedData:
        if self.data is None:
            self.data = load_prepared(self.directory, tokenizer=self.tokenizer,
                                      val_fraction=self.val_fraction, prepare_hint=self.prepare_command)
            # val_fraction moves tokens from train.bin to val.bin: the advice depends on which one is short,
            # and a new fraction applies only to a corpus prepared again (meta.json keeps the old split).
            direction = {"train": "smaller", "val": "larger"}
            for split in ("train", "val"):
                if self.data.num_tokens(split) <= self.seq_len + 1:
                    raise PreparedDataError(
                        f"{self.data.path(split)} has {self.data.num_tokens(split)} tokens: too few for "
                        f"sequences of {self.seq_len}; use more data or a shorter seq_len, or a "
                        f"{direction[split]} data.val_fraction (now {self.data.meta.get('val_fraction')}; it "
                        f"applies once {self.directory} is deleted and prepared again)"
                    )
        return self.data

    def setup(self, stage: str | None = None) -> None:
        self.load()

    def _loader(self, dataset: TokenWindows, sampler) -> DataLoader:
        return DataLoader(dataset, batch_size=self.micro_batch, sampler=sampler, num_workers=self.num_workers,
                          pin_memory=torch.cuda.is_available(), persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        data = self.load()
        dataset = TokenWindows(str(data.path("train")), data.num_tokens("train"), self.seq_len,
                               self.global_batch, self.seed)
        trainer = self.trainer
        sampler = StepSampler(global_batch=self.global_batch, micro_batch=self.micro_batch,
                              rank=trainer.global_rank, world_size=trainer.world_size,
                              max_steps=self.max_steps, start_step=lambda: trainer.global_step)
        return self._loader(dataset, sampler)

    def val_dataloader(self) -> DataLoader:
        data = self.load()
        world = self.trainer.world_size
        # Equal shards on every rank, or synchronized logging would wait on a rank with fewer batches; the
        # last micro-batch may be smaller, so the windows (and the loss, a mean over them) are the same at
        # any micro_batch.
        count = max(world, self.val_sequences // world * world)
        if count != self.val_sequences and self.trainer.is_global_zero:
            log.warning("val_sequences=%d: %d validation windows, a multiple of the %d devices",
                        self.val_sequences, count, world)
        dataset = TokenWindows(str(data.path("val")), data.num_tokens("val"), self.seq_len, count,
                               self.val_seed)
        return self._loader(dataset, ShardSampler(count, self.trainer.global_rank, world))
