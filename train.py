"""Train a GPT-2 arm: ``python train.py norm=rms size=1b`` (Hydra composes conf/train.yaml).

The LayerNorm and RMSNorm arms differ only in ``norm``: same seed, same initial non-norm weights,
same batch stream, same probe tokens and reference vectors.
"""

from __future__ import annotations

# ruff: noqa: E402  (the SLURM signal handler is installed before the slow imports, on purpose)
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class SlurmRequeue:
    """SLURM's USR1 (``--signal=USR1@lead`` before the time limit, preemption, ``scancel --signal=USR1``):
    save the run, requeue the job, exit.

    Python dies of a USR1 it has no handler for, so this handler goes in before the slow imports. Once
    training runs it only records the signal: :class:`RequeueOnSignal` stops all ranks at the next
    optimizer-step boundary, ``last.ckpt`` is written and :func:`main` requeues the job. Before training
    starts there is nothing new to save, so the job is requeued at once.
    """

    def __init__(self) -> None:
        self.received = False
        self.training = False
        self.stopped_at: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.received = True
        if self.training:
            return
        print("USR1 before training started: requeueing the job", file=sys.stderr, flush=True)
        # Every rank requeues (a duplicate request fails harmlessly): a rank that exits without it
        # could leave the others waiting in a collective for the rest of the time limit.
        if requeue_slurm_job():
            raise SystemExit(0)
        self.received = False  # SLURM refused (e.g. --no-requeue): carry on


def requeue_slurm_job() -> bool:
    """``scontrol requeue`` this job: SLURM ends it and starts it again with the same id."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID")
    try:
        done = subprocess.run(["scontrol", "requeue", str(job)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        print(f"scontrol requeue {job} failed: {err}", file=sys.stderr, flush=True)
        return False
    if done.returncode:
        print(f"scontrol requeue {job} failed: {done.stderr.strip()}", file=sys.stderr, flush=True)
        return False
    print(f"SLURM job {job} requeued", file=sys.stderr, flush=True)
    return True


def install_requeue_handler() -> SlurmRequeue | None:
    """The USR1 handler of this process under SLURM (installed once); None outside SLURM."""
    current = signal.getsignal(signal.SIGUSR1)
    if isinstance(current, SlurmRequeue):
        return current
    # SLURMEnvironment.detect()'s rule: srun/sbatch tasks, not an interactive allocation's shell.
    under_slurm = "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    if not under_slurm or threading.current_thread() is not threading.main_thread():
        return None
    handler = SlurmRequeue()
    signal.signal(signal.SIGUSR1, handler)
    return handler


install_requeue_handler()

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from callbacks.checkpointing import (
    AtomicCheckpointIO,
    CheckpointSchedule,
    NonFiniteError,
    RequeueOnSignal,
    ScheduledCheckpoint,
    StopAtStep,
)
from callbacks.progress import StepProgressBar, quiet_lightning
from corpus.prepare import PreparedDataError
from corpus.sources import SourceError
from normgeo.config import CONF_DIR
from normgeo.hardware import default_precision
from normgeo.lit import LitGPT
from normgeo.logged_figures import figure_key, log_figures
from normgeo.run_config import (
    ResumeConfigError,
    is_rank_zero,
    resolved_run_config,
    save_run_config,
)
from normgeo.session import REFUSALS, Refused, RunDirectoryError, resume_checkpoint, session_checkpoint  # noqa: F401
from normgeo.summary import SUMMARY_FILE, SessionClock, format_summary, run_summary, write_summary

log = logging.getLogger("normgeo.train")
WANDB_ID_FILE = "wandb_run_id.txt"
SLURM_JOBS_FILE = "slurm_jobs.tsv"


def record_slurm_job(run_dir: Path) -> None:
    """One line per SLURM session of the run (job id, restart count, start, node) for normgeo.status."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_PROCID", "0") != "0":
        return
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    line = f"{job}\t{os.environ.get('SLURM_RESTART_COUNT', '0')}\t{started}\t{os.uname().nodename}\n"
    with open(run_dir / SLURM_JOBS_FILE, "a") as handle:
        handle.write(line)


def make_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """The loggers of ``cfg.logger``: a dict name -> config (conf/logger/*.yaml combine, e.g. logger=[csv,wandb]);
    a null entry (logger.wandb=null) is skipped; a plain list still works."""
    configs = cfg.logger.values() if isinstance(cfg.logger, DictConfig) else (cfg.logger or [])
    loggers = []
    for logger_cfg in configs:
        if not logger_cfg:
            continue
        if logger_cfg._target_.endswith("WandbLogger"):
            loggers.append(make_wandb_logger(logger_cfg, run_dir))
        else:
            loggers.append(instantiate(logger_cfg))
    return loggers


def make_wandb_logger(logger_cfg: DictConfig, run_dir: Path):
    """Same wandb run across resumes (id kept in the run directory); offline when no key is set up."""
    id_file = run_dir / WANDB_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
    else:
        run_id = secrets.token_hex(4)  # OS entropy, not the seeded RNGs (wandb 0.31 has no util.generate_id)
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
    quiet_lightning()  # before SLURMEnvironment and the Trainer print their hints
    if cfg.trainer.enable_progress_bar:
        callbacks = [*callbacks, StepProgressBar()]  # optimizer steps of max_steps, not Lightning's epochs
    plugins: list = [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        # Ranks and world size from SLURM. USR1 (--signal=USR1@lead, scancel --signal=USR1, preemption)
        # is ours, not Lightning's: SlurmRequeue + RequeueOnSignal stop at a step boundary, write
        # last.ckpt and requeue; Lightning's handler would save mid-step from inside the signal handler.
        plugins.append(SLURMEnvironment(auto_requeue=False))
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


def describe_run(cfg: DictConfig, trainer: L.Trainer, module: LitGPT) -> str:
    """The start-up line that replaces Lightning's model summary table (whose FLOPs column reads 0)."""
    params = module.model.num_parameters()
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return (
        f"model: {count} parameters, norm={cfg.norm.name} ({cfg.placement.name}), {cfg.size.n_layer} layers, d={cfg.size.n_embd}"
        f" · {cfg.global_batch * cfg.seq_len:,} tokens per optimizer step ({cfg.global_batch} sequences x "
        f"{cfg.seq_len}) · accumulation {trainer.accumulate_grad_batches} x micro_batch {cfg.micro_batch} x "
        f"world size {trainer.world_size} · precision {trainer.precision}"
    )


def train(cfg: DictConfig) -> L.Trainer:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    requeue = install_requeue_handler()
    # Before this session writes anything into the run directory (conf/train.yaml already kept Hydra's
    # files out of a refused one): a resume continues the same experiment, a new run a new directory.
    ckpt_path = session_checkpoint(cfg)
    run_config = resolved_run_config(cfg)
    record_slurm_job(run_dir)
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
                null_directions=cfg.probe.null_directions,
                min_doc_tokens=cfg.probe.min_doc_tokens,
                sample_documents=cfg.probe.sample,
                bootstrap_replicates=cfg.probe.bootstrap.replicates,
                bootstrap_block=cfg.probe.bootstrap.block,
            )
        )
    clock = SessionClock()
    callbacks.append(clock)
    if requeue is not None:
        callbacks.append(RequeueOnSignal(requeue))  # last: acts after this step's checkpoint and probe
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
            "placement": cfg.placement.name,
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
    module.run_config = run_config  # into every checkpoint
    if trainer.is_global_zero:
        log.info("%s", describe_run(cfg, trainer, module))
    datamodule = instantiate(cfg.data)
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
    elif is_rank_zero():
        # As late as possible, so that a session refused for a bad setting leaves no config behind.
        save_run_config(run_dir, run_config)  # the first session's; never replaced
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if requeue is not None and requeue.stopped_at is not None:
        return trainer  # main() requeues; the figures come when the run is complete
    figures: list[Path] = []
    if trainer.is_global_zero and cfg.probe.enabled:
        from normgeo.report import write_run_figures

        figures = write_run_figures(run_dir)
        for figure in figures:
            log.info("figure: %s", figure)
        log_figures(trainer.loggers, {figure_key(f): f for f in figures}, step=trainer.global_step)
    if trainer.is_global_zero:
        summary = run_summary(trainer, clock, run_dir, tokens_per_step=cfg.global_batch * cfg.seq_len, figures=figures)
        write_summary(run_dir, summary)
        log.info("%s\n  summary:     %s", format_summary(summary), run_dir / SUMMARY_FILE)
    return trainer


def finish_wandb_run() -> None:
    """Close this session's wandb run. Lightning leaves it open, and in a local ``-m`` sweep (all jobs in
    one process) the next job's WandbLogger would then log into it instead of its own run."""
    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish()


def refuse(cfg: DictConfig, err: Exception) -> Refused:
    """Exit 2 with the reason; in a ``-m`` sweep return it instead, so that the other jobs still run
    (normgeo.session.RefusalReport lists the refused ones when the sweep ends)."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Refused(str(cfg.run_dir), str(err))
    sys.exit(2)


USER_ERRORS = (PreparedDataError, SourceError, RunDirectoryError, ResumeConfigError, NonFiniteError, ValueError)


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> Refused | None:
    # Again here: the submitit launcher unpickles main() on the node without running this file's top.
    requeue = install_requeue_handler()
    try:
        session_checkpoint(cfg)  # refused: say so without logging a session into the run's train.log
    except REFUSALS as err:
        return refuse(cfg, err)
    log.info("run directory: %s", cfg.run_dir)
    try:
        trainer = train(cfg)
    except USER_ERRORS as err:
        return refuse(cfg, err)
    finally:
        finish_wandb_run()
    if requeue is not None and requeue.stopped_at is not None:
        if trainer.is_global_zero and not requeue_slurm_job():
            print(
                f"error: stopped after step {requeue.stopped_at} for a requeue that SLURM refused; "
                "submit the job again with resume=auto to continue from last.ckpt",
                file=sys.stderr,
            )
            sys.exit(3)
        # Exit rather than return: under submitit a return would record the job as finished.
        sys.exit(0)


if __name__ == "__main__":
    main()
