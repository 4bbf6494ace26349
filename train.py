"""Train a GPT-2 arm: ``python train.py norm=rms size=1b`` (Hydra composes conf/train.yaml).

The LayerNorm and RMSNorm arms differ only in ``norm``: same seed, same initial non-norm weights,
same batch stream, same probe tokens and reference vectors.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import sys
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from callbacks.checkpointing import (
    LAST,
    AtomicCheckpointIO,
    NonFiniteError,
    CheckpointSchedule,
    ScheduledCheckpoint,
    StopAtStep,
)
from corpus.prepare import PreparedDataError
from corpus.sources import SourceError
from normgeo.config import CONF_DIR
from normgeo.hardware import default_precision
from normgeo.lit import LitGPT

log = logging.getLogger("normgeo.train")
WANDB_ID_FILE = "wandb_run_id.txt"


class RunDirectoryError(RuntimeError):
    """The run directory holds an earlier run and no resume was asked for."""


def resume_checkpoint(run_dir: Path, resume: str | None) -> str | None:
    """The checkpoint to continue from: the newest of last.ckpt and SLURM's hpc_ckpt_*.ckpt."""
    candidates = [Path(p) for p in glob.glob(str(run_dir / "hpc_ckpt_*.ckpt"))]
    candidates += [p for p in [run_dir / "checkpoints" / LAST] if p.exists()]
    if resume is None:
        if candidates:
            raise RunDirectoryError(
                f"{run_dir} already holds a run ({candidates[0].name}). Continue it with resume=auto, "
                "or start another with a different run_name=... or seed=..."
            )
        return None
    if resume == "auto":
        return str(max(candidates, key=lambda p: p.stat().st_mtime)) if candidates else None
    if not Path(resume).is_file():
        raise RunDirectoryError(f"resume={resume!r}: no such checkpoint file (use resume=auto or a .ckpt path)")
    return resume


def make_loggers(cfg: DictConfig, run_dir: Path) -> list:
    loggers = []
    for logger_cfg in cfg.logger or []:
        if logger_cfg._target_.endswith("WandbLogger"):
            loggers.append(make_wandb_logger(logger_cfg, run_dir))
        else:
            loggers.append(instantiate(logger_cfg))
    return loggers


def make_wandb_logger(logger_cfg: DictConfig, run_dir: Path):
    """Same wandb run across resumes (id kept in the run directory); offline when no key is set up."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
    else:
        run_id = wandb.util.generate_id()
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
            id_file.write_text(run_id + "\n")
    has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not has_key
    if offline:
        log.info("wandb: no API key or WANDB_MODE=offline, logging offline; upload later with `wandb sync`")
    return instantiate(logger_cfg, id=run_id, resume="allow", offline=offline)


def _netrc_has_wandb() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list) -> L.Trainer:
    plugins: list = [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        # On USR1 (sent by --signal=USR1@lead, scancel --signal=USR1 or preemption) Lightning writes
        # hpc_ckpt_N.ckpt into the run directory and requeues the job, which then resumes from it.
        plugins.append(SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1))
    precision = cfg.trainer.precision or default_precision()
    trainer = instantiate(
        cfg.trainer,
        precision=precision,
        max_steps=cfg.max_steps,
        max_epochs=-1,
        default_root_dir=str(run_dir),
        callbacks=callbacks,
        logger=make_loggers(cfg, run_dir),
        plugins=plugins,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
    )
    # The global batch is fixed; accumulation is whatever the device count leaves over.
    per_step = cfg.micro_batch * trainer.world_size
    if cfg.global_batch % per_step:
        raise ValueError(
            f"global_batch={cfg.global_batch} is not divisible by micro_batch={cfg.micro_batch} x "
            f"{trainer.world_size} devices; pick micro_batch so that the product divides it"
        )
    trainer.accumulate_grad_batches = cfg.global_batch // per_step
    trainer.val_check_interval = cfg.val_every * trainer.accumulate_grad_batches
    return trainer


def train(cfg: DictConfig) -> L.Trainer:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = resume_checkpoint(run_dir, cfg.resume)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    schedule = CheckpointSchedule(
        cfg.max_steps,
        steps=cfg.checkpoint.steps,
        dense_every=cfg.checkpoint.dense_every,
        dense_until=cfg.checkpoint.dense_until,
        sparse_every=cfg.checkpoint.sparse_every,
    )
    callbacks: list = [
        ScheduledCheckpoint(
            str(run_dir / "checkpoints"),
            schedule,
            last_every=cfg.checkpoint.last_every,
            keep_optimizer=cfg.checkpoint.keep_optimizer,
        )
    ]
    if cfg.stop_at_step:
        callbacks.append(StopAtStep(cfg.stop_at_step))
    if cfg.probe.enabled:
        from callbacks.angle_probe import AngleProbe

        callbacks.append(
            AngleProbe(
                str(run_dir),
                schedule,
                instantiate(cfg.probe.source),
                model_name=f"normgeo-{cfg.size.name}",
                tokens=cfg.probe.tokens,
                batch_size=cfg.probe.batch_size,
                seed=cfg.probe.seed,
                include_standardized=cfg.probe.include_standardized,
            )
        )
    trainer = build_trainer(cfg, run_dir, callbacks)
    for logger in trainer.loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    module = LitGPT(
        model={
            "n_layer": cfg.size.n_layer,
            "n_head": cfg.size.n_head,
            "n_embd": cfg.size.n_embd,
            "block_size": cfg.seq_len,
            "norm": cfg.norm.name,
            "norm_eps": cfg.norm.eps,
            "tie_embeddings": cfg.tie_embeddings,
        },
        seed=cfg.seed,
        max_steps=cfg.max_steps,
        global_batch=cfg.global_batch,
        lr=cfg.optim.lr,
        min_lr_ratio=cfg.optim.min_lr_ratio,
        warmup_steps=cfg.optim.warmup_steps,
        weight_decay=cfg.optim.weight_decay,
        betas=tuple(cfg.optim.betas),
        compile=cfg.compile,
    )
    datamodule = instantiate(cfg.data)
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if trainer.is_global_zero and cfg.probe.enabled:
        from normgeo.report import write_run_figures

        for figure in write_run_figures(run_dir):
            log.info("figure: %s", figure)
    return trainer


USER_ERRORS = (PreparedDataError, SourceError, RunDirectoryError, NonFiniteError, ValueError)


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    log.info("run directory: %s", cfg.run_dir)
    try:
        train(cfg)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
