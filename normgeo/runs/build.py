"""The one map from train.py's config to what a run is built from:
the LightningModule, the data module and the checkpoint schedule.

Each value lives under one key of the config (``seq_len``, ``norm.name``, ``optim.lr``); these functions hand
it to every object that needs it, so no node of conf/ copies another's keys (and a resumed run's config has no
aliases to compare). train.py, bench/, normgeo.plan and the tests build from here, every ``_target_`` node
through :func:`build`. """

from __future__ import annotations

from typing import Any

from corpus.datamodule import TokenDataModule
from models.hardware import default_precision
from models.lit import LitGPT
from normgeo.config.checks import build
from normgeo.config.schema import TrainSchema, compiles


def make_module(cfg: TrainSchema, **changes: Any) -> LitGPT:
    """The LightningModule of ``cfg`` (``changes``: arguments that differ, e.g. bench/'s ``seed=0``)."""
    arguments = {"seed": cfg.seed, "max_steps": cfg.max_steps, "global_batch": cfg.global_batch,
                 "compile": compiles(cfg)}
    return LitGPT(cfg.gpt, cfg.optim, **{**arguments, **changes})


def make_datamodule(cfg: TrainSchema) -> TokenDataModule:
    """``cfg.data`` (its own keys: the source, the prepared folder, the tokenizer, the batch order's seed)
    with the run's batch geometry, steps, validation and workers."""
    return build(cfg.data, "data", seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                       micro_batch=cfg.micro_batch, max_steps=cfg.max_steps, val_sequences=cfg.val_sequences,
                       val_seed=cfg.val_seed, num_workers=cfg.num_workers)


def trainer_arguments(cfg: TrainSchema) -> dict[str, Any]:
    """What the run sets on ``cfg.trainer``'s Trainer: its steps, validation
    by steps (not epochs), no sanity validation, and precision null as the
    hardware's default (bf16-mixed on GPUs that have it, else 32-true)."""
    return {"precision": cfg.trainer.get("precision") or default_precision(), "max_steps": cfg.max_steps,
            "max_epochs": -1, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0}


def make_schedule(cfg: TrainSchema) -> Any:
    """``cfg.checkpoint``'s schedule (callbacks.checkpointing.CheckpointSchedule), ending with max_steps."""
    return build(cfg.checkpoint, "checkpoint", max_steps=cfg.max_steps)
