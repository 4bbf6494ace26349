"""A train.py session from its accepted start (normgeo.runs.start) to its exit: :class:`Run` fits it
(:func:`train`: the Trainer with its callbacks and loggers, the fit, the end's summary and figures) and
finishes it. bench/ calls :func:`train` with its own callbacks."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LambdaCallback, Timer
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment

from callbacks.angle_probe import AngleProbe
from callbacks.checkpointing import AtomicCheckpointIO, CheckpointSchedule, ScheduledCheckpoint
from callbacks.lightning_loops import ResumedAccumulation
from callbacks.optimizer_step import OptimizerStepCallback
from callbacks.progress import StepProgressBar, quiet_lightning
from callbacks.signal_stop import StopOnSignal, exit_if_interrupted
from corpus.atomic import atomic_write_text
from corpus.refusal import Refusal
from models.divergence import NonFiniteError
from models.lit import LitGPT
from normgeo.config.checks import Refused, build, refuse
from normgeo.config.compose import close_file_logs
from normgeo.config.schema import (
    TrainSchema,
    costly_values,
    launch_cost,
    odd_values,
    training_device_type,
    unmeasured_values,
)
from normgeo.figures.angle_panels import write_run_figures
from normgeo.figures.logged_figures import figure_key, log_figures
from normgeo.measure.records import DamagedRecords
from normgeo.run_folder import CSV_DIR, RunFolder
from normgeo.runs.build import make_module, make_schedule
from normgeo.runs.formats import logger_nodes
from normgeo.runs.lock import RunInUseError, RunLock
from normgeo.runs.run_config import (
    checkpoint_run_config,
    is_rank_zero,
    record_run_config,
    resolved_run_config,
)
from normgeo.runs.session import DIVERGED, RunFinished, continue_command, disk_full_refusal, mark_diverged
from normgeo.runs.start import Start, finish_wandb_run, instantiate_trainer, open_run_files
from normgeo.runs.summary import disk_use, format_summary, read_summary, write_summary
from normgeo.signals import (
    FIGURES,
    INTERRUPTED_END,
    OWNER,
    STOP,
    STOP_SIGNALS,
    Abandoned,
    FitPhase,
    Phase,
    SignalStop,
)
from slurm.requeue import record_slurm_job, requeue_slurm_job

log = logging.getLogger("normgeo.train")


class Run:
    """One train.py session of a run, from its accepted start."""

    def __init__(self, start: Start) -> None:
        self.start = start
        self.trainer: L.Trainer | None = None

    def fit(self) -> Refused | None:
        """Open the run's files and :func:`train`; a start that trained nothing is undone. A user's mistake (a
        divergence, a full disk) is one line (exit 2; Refused in a sweep), anything else has its traceback."""
        start, cfg = self.start, self.start.config
        try:
            open_run_files(start)  # .hydra/ and train.log, now that this start is accepted
            log.info("run directory: %s", cfg.run_dir)
            self.trainer = train(start)
            if not start.kept:  # stopped before its first optimizer step (a signal in the first probe): it
                start.undo()  # trained and saved nothing, and the folder goes back to how the start found it
        except BaseException as err:
            stopped = isinstance(err, SystemExit) and err.code in {128 + s for s in STOP_SIGNALS}
            if not start.kept:  # before its first optimizer step
                if isinstance(err, (NonFiniteError, SystemExit)) and not stopped:
                    start.keep()  # a divergence is a result, a requeue a pause: the start stays
                else:
                    start.undo()  # a failure or a stop: the directory as it was found
            refusal = err if isinstance(err, Refusal) else (  # a full disk, however torch wrapped it, too
                disk_full_refusal(err, cfg) if isinstance(err, Exception) else None)
            if refusal is not None:
                return refuse(cfg.run_dir, refusal)
            raise
        finally:
            finish_wandb_run()
            start.release()
            close_file_logs(start.run_dir)  # train.log: the next job of a -m sweep (same process) has its own
        return None

    def finish(self) -> None:
        """Exit as the session stopped: a signal's resume command (130/143), a requeue (0; 3 if refused)."""
        trainer = self.trainer
        assert trainer is not None, "Run.fit first"
        exit_if_interrupted(trainer)  # Ctrl-C/SIGTERM: last.ckpt saved; the resume command, exit 130/143
        requeue = OWNER.requeue
        if requeue is not None and requeue.stopped_at is not None:
            if trainer.is_global_zero and not requeue_slurm_job():
                print(f"error: stopped after step {requeue.stopped_at} for a requeue that SLURM refused; "
                      "submit the job again with resume=auto to continue from last.ckpt", file=sys.stderr)
                sys.exit(3)
            # Exit rather than return: under submitit a return would record the job as finished.
            sys.exit(0)


def finished(run_dir: Path, done: RunFinished) -> Refused | None:
    """A resume with nothing left to train: one line, exit 0 (a sweep's other jobs go on); an end interrupted
    after its summary has its figures drawn, under the run's lock."""
    print(done, flush=True)
    if done.figures_left:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
            draw_figures(run_dir)
        except RunInUseError as err:
            return refuse(run_dir, err)
        finally:
            lock.release()  # nothing when the lock was not taken
    return None


def make_loggers(cfg: TrainSchema, run_dir: Path) -> list:
    """The loggers of ``cfg.logger`` (a dict name -> node, so that conf/train/logger/*.yaml combine; a null
    entry is skipped), and always a CSVLogger: its metrics.csv is what the readers read."""
    loggers: list = [CSVLogger(save_dir=run_dir, name=CSV_DIR)]
    for logger_cfg in logger_nodes(cfg.logger, RunFolder(run_dir).csv):
        wandb = logger_cfg["_target_"].endswith("WandbLogger")
        loggers.append(build(logger_cfg, "logger", **(wandb_arguments(run_dir) if wandb else {})))
    return loggers


WANDB_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what wandb accepts as a run id, and writes


def wandb_arguments(run_dir: Path) -> dict[str, Any]:
    """Same wandb run across resumes (id kept in the run directory); offline when no key is set up."""
    id_file = RunFolder(run_dir).wandb_id
    run_id = id_file.read_text(errors="replace").strip() if id_file.exists() else None
    if run_id is not None and not WANDB_RUN_ID.fullmatch(run_id):  # named, and the run goes on
        log.warning("%s is damaged (%r is no wandb run id): this session logs to a new wandb run", id_file,
                    run_id[:40])
        run_id = None
    if run_id is None:
        run_id = secrets.token_hex(4)  # OS entropy, not the seeded RNGs (wandb 0.31 has no util.generate_id)
        if is_rank_zero():
            atomic_write_text(id_file, run_id + "\n")
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"))
    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not has_key
    if offline:
        log.info("wandb: no API key or WANDB_MODE=offline, logging offline; upload later with `wandb sync`")
    return {"id": run_id, "resume": "allow", "offline": offline}


def build_trainer(cfg: TrainSchema, run_dir: Path, callbacks: list) -> L.Trainer:
    quiet_lightning()  # before SLURMEnvironment and the Trainer print their hints
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks = [*callbacks, StepProgressBar()]  # optimizer steps of max_steps, not Lightning's epochs
    plugins: list = [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        # Ranks and world size from SLURM. USR1 (--signal=USR1@lead, scancel --signal=USR1, preemption)
        # is ours, not Lightning's: SlurmRequeue + StopOnSignal stop at a step boundary, write
        # last.ckpt and requeue; Lightning's handler would save mid-step from inside the signal handler.
        plugins.append(SLURMEnvironment(auto_requeue=False))
    trainer = instantiate_trainer(cfg, default_root_dir=str(run_dir), callbacks=callbacks,
                                  logger=make_loggers(cfg, run_dir), plugins=plugins)
    # The global batch is fixed; accumulation is whatever the device count leaves over: known once Lightning
    # has counted the devices, so set on the Trainer it built (a refusal undoes the start).
    trainer.accumulate_grad_batches = cfg.accumulation(trainer.world_size)
    trainer.val_check_interval = cfg.val_every * trainer.accumulate_grad_batches
    return trainer


def describe_run(cfg: TrainSchema, trainer: L.Trainer, module: LitGPT) -> str:
    """The start-up line that replaces Lightning's model summary table (whose FLOPs column reads 0)."""
    params = module.model.num_parameters()
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    probe = "probe off"
    if cfg.probe.enabled:
        scopes = list(cfg.probe.intervention)
        probe = f"probe {cfg.probe.tokens:,} tokens" + (
            f", centering intervention {','.join(scopes)} on the first "
            f"{min(cfg.probe.intervention_tokens or cfg.probe.tokens, cfg.probe.tokens):,}"
            if scopes else ", no centering intervention")
    return (f"model: {count} parameters, norm={cfg.norm.name} ({cfg.placement.name}-norm), "
            f"{cfg.size.n_layer} layers, d={cfg.size.n_embd} · {module.tokens_per_step:,} tokens per "
            f"optimizer step ({cfg.global_batch} sequences x {cfg.seq_len}) · accumulation "
            f"{trainer.accumulate_grad_batches} x micro_batch {cfg.micro_batch} x world size "
            f"{trainer.world_size} · precision {trainer.precision} · {probe}")


# The summary of a session (normgeo.runs.summary's file). The wall time is Lightning's ``Timer``, restored on
# resume: the training time behind the checkpointed state (a killed session's up to its last checkpoint).
def session_wall_s(trainer: L.Trainer, timer: Timer) -> float:
    """This session's training time (validation and probes included): the Timer's, less what it restored.
    A session ended by a signal or a divergence skips ``on_train_end``: its clock is stopped here, so that
    this time and the run's (``timer.time_elapsed()``) are read at one instant and a first session's agree."""
    started = timer.start_time()
    if started is None:
        return 0.0
    if timer.end_time() is None:
        timer.on_train_end(trainer, trainer.lightning_module)
    return timer.end_time() - started


def _metric(trainer: L.Trainer, name: str) -> float | None:
    value = trainer.callback_metrics.get(name)
    return None if value is None else float(value)


def _log_dir(logger: Any) -> str | None:
    if isinstance(logger, WandbLogger):
        return str(Path(logger.experiment.dir).parent)  # wandb/<offline->run-<time>-<id>
    return getattr(logger, "log_dir", None)


def run_summary(trainer: L.Trainer, timer: Timer, run_dir: Path, start_step: int,
                stopped_by: str | None = None) -> dict[str, Any]:
    """The run's summary after this session (begun at ``start_step``), merged with the earlier sessions';
    ``stopped_by``: why the session ended early ("interrupted by SIGINT", "requeue"). Its figures are listed
    once drawn (draw_figures)."""
    folder = RunFolder(run_dir)
    try:
        previous = read_summary(run_dir) if start_step > 0 else {}
    except DamagedRecords as err:  # rewritten from this session's state: the earlier sessions' log is lost
        log.warning("%s; rewriting it from the run's state", err)
        previous = {}
    step, tokens_per_step = trainer.global_step, trainer.lightning_module.tokens_per_step
    session_tokens = (step - start_step) * tokens_per_step
    session_s = session_wall_s(trainer, timer)
    this_session = {"steps": [start_step, step], "wall_s": round(session_s, 3),
                    "ended": stopped_by or ("finished" if step >= trainer.max_steps else "stopped")}
    return {
        "step": step, "max_steps": trainer.max_steps, "finished": step >= trainer.max_steps,
        "train_loss": _metric(trainer, "train/loss"), "val_loss": _metric(trainer, "val/loss"),
        "val_step": getattr(trainer.lightning_module, "validated_at", None),  # the validation it is from
        "tokens_seen": step * tokens_per_step, "wall_s": round(timer.time_elapsed(), 3),
        # A killed session wrote no summary, but its CSV log (csv/version_<n>, one per session) is there.
        "sessions": max(int(previous.get("sessions") or 0) + 1, len(list(folder.csv.glob("version_*")))),
        "session_wall_s": round(session_s, 3),
        # One entry per session that wrote a summary (read_summary gives an older summary an empty list).
        "session_log": [*previous.get("session_log", []), this_session],
        "tokens_per_s": round(session_tokens / session_s, 1) if session_s > 0 else None,
        "records": str(folder.angles) if folder.angles.is_file() else None,
        "figures": [], "checkpoints": str(folder.checkpoints),
        "logs": {type(logger).__name__: _log_dir(logger) for logger in trainer.loggers},
        "train_log": str(folder.train_log), "disk_bytes": disk_use(run_dir),
    }


class KeepStart(OptimizerStepCallback):
    """Keeps the start at this session's first optimizer step: a failure from then on keeps its files."""

    def __init__(self, start: Start) -> None:
        self.start = start

    def on_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        self.start.keep()


def train(start: Start, extra_callbacks: Sequence[L.Callback] = ()) -> L.Trainer:
    """Fit one run: ``start`` is what normgeo.runs.start checked and claimed, its typed config included
    (bench/ calls ``with start_session(composed) as start: train(start, ...)`` with its timers)."""
    cfg = start.config
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    requeue = OWNER.take_requeue()
    ckpt_path = start.ckpt_path  # a resume continues the same experiment, a new run a new directory
    start.replace_diverged_run()  # a diverged run in this folder: this corrected start replaces it
    run_config = resolved_run_config(cfg)
    record_slurm_job(run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.threads is not None:  # a fixed count: the floating-point order is part of the experiment
        torch.set_num_threads(cfg.threads)

    schedule: CheckpointSchedule = make_schedule(cfg)
    # SLURM's USR1 requeues; the user's Ctrl-C or SIGTERM saves and exits (at once during a validation or a
    # probe). Its handler is installed first; the checkpoint owner asks it after each step's probe.
    stop = StopOnSignal(requeue, lambda: continue_command(cfg), RunFolder(run_dir).last_checkpoint)
    timer = Timer(verbose=False)  # the run's training time, kept in its checkpoints (summary.json's wall_s)
    keep = KeepStart(start)
    # The checkpoint owner (the schedule, stop_at_step, the signal stop) and the probe at the same steps (its
    # tokens as the start tokenized them).
    owner = ScheduledCheckpoint(str(RunFolder(run_dir).checkpoints), schedule,
                                stop_at_step=cfg.stop_at_step or None, signal_stop=stop)
    source = build(cfg.probe.source, "probe.source") if cfg.probe.enabled else None
    probe = [AngleProbe(str(run_dir), schedule, source, f"normgeo-{cfg.size.name}", cfg.probe,
                        ids=start.probe_ids)] if cfg.probe.enabled else []
    # In the order the run relies on, which Lightning keeps (it sorts Checkpoint callbacks last): the signal
    # handler installed before another callback's on_train_start (the step-0 probe), the checkpoint owner
    # deciding after the step's probe measured.
    callbacks = [LambdaCallback(on_train_start=stop.install), keep, *probe, *extra_callbacks,
                 ResumedAccumulation(), timer, stop, owner]
    module = make_module(cfg)
    datamodule = start.datamodule  # prepared and long enough for seq_len (checked)
    trainer = build_trainer(cfg, run_dir, callbacks)
    assert trainer.callbacks[0] is callbacks[0] and trainer.callbacks[-1] is owner, trainer.callbacks
    for logger in trainer.loggers:
        logger.log_hyperparams(run_config)
    module.run_config = run_config  # into every checkpoint
    if trainer.is_global_zero:
        log.info("%s", describe_run(cfg, trainer, module))
        # Legal but costly, valid but probably not meant, asked for but nothing
        # to measure: each said once in one line, and the run goes on as asked.
        launch = launch_cost(cfg, parameters=module.model.num_parameters(),
                             train_tokens=datamodule.data.num_tokens("train"),
                             device=training_device_type(cfg.trainer), precision=str(trainer.precision))
        for kind, lines in (("costly launch", launch),
                            ("costly", costly_values(cfg, probes=len(schedule) + 1, checkpoints=len(schedule),
                                                     parameters=module.model.num_parameters(),
                                                     free_bytes=shutil.disk_usage(run_dir).free)),
                            ("odd", odd_values(cfg)),
                            ("nothing measured", unmeasured_values(cfg))):
            for line in lines:
                log.warning("%s: %s", kind, line)
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
    if is_rank_zero():  # as late as possible: a session refused for a bad setting leaves no config behind
        record_run_config(run_dir, (ckpt_path and checkpoint_run_config(ckpt_path)) or run_config)
    # Owned here as well as in train.py's main(): bench/ calls train() without it.
    fit_phase = FitPhase(lambda: start.kept)
    with OWNER.owning(fit_phase):
        try:
            # A validation or a probe abandoned on a signal ends fit with SignalStop, last.ckpt saved.
            with contextlib.suppress(SignalStop):
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        except NonFiniteError as err:  # recorded, so that the corrected command may replace this run
            summary = (run_summary(trainer, timer, run_dir, keep.session_start_step, stopped_by=DIVERGED)
                       if trainer.is_global_zero else None)
            raise mark_diverged(run_dir, summary, err) from None
        if trainer.is_global_zero and start.kept:  # one that trained nothing: Run.fit undoes it
            # The end is part of the run: its summary first, while fit_phase holds a signal; from then on a
            # signal, held meanwhile (after the last step's poll, in fit's teardown) or arriving in the
            # figures, abandons the end and end_interrupted records it in the summary, exit 128 + the signal.
            late = stop.late_signal or fit_phase.received
            stopped_by = stop.stopped_by or (f"interrupted by {signal.Signals(late).name}" if late else None)
            write_summary(run_dir, run_summary(trainer, timer, run_dir, keep.session_start_step, stopped_by))
            try:
                # From here a signal abandons the end; fit_phase saw the last one it will see, so the check
                # below and the handler together cover every moment after the summary.
                with OWNER.owning(Phase(FIGURES)):
                    if (signum := stop.late_signal or fit_phase.received) is not None:
                        raise Abandoned(signum)
                    if cfg.probe.enabled and cfg.probe.figures and stopped_by is None:
                        figures = draw_figures(run_dir)
                        log_figures(trainer.loggers, {figure_key(f): f for f in figures},
                                    step=trainer.global_step)
                    log.info("%s\n  summary:     %s", format_summary(read_summary(run_dir)),
                             RunFolder(run_dir).summary)
            except Abandoned as abandoned:
                end_interrupted(run_dir, abandoned.signum, continue_command(cfg))
    return trainer


def end_interrupted(run_dir: Path, signum: int, command: str) -> None:
    """A signal at the end, after the summary: the summary says the session was interrupted (where it did not
    yet), one line says what is left, exit 128 + the signal."""
    end = Phase(INTERRUPTED_END, "after training, while the summary and figures were written",
                f"the trained steps are checkpointed; {command} writes the rest, nothing retrained")
    with OWNER.owning(end):  # a second signal stops at once; the atomic write keeps the summary whole
        summary = read_summary(run_dir)
        ended = f"interrupted by {signal.Signals(signum).name}"
        if summary["session_log"][-1]["ended"] != ended:
            summary["session_log"][-1]["ended"] = ended
            write_summary(run_dir, summary)
        end.act(STOP, signum)


def draw_figures(run_dir: Path) -> list[Path]:
    """The run's figures from its records, then listed in its summary (written before them)."""
    figures = write_run_figures(run_dir)
    for figure in figures:
        log.info("figure: %s", figure)
    write_summary(run_dir, {**read_summary(run_dir), "figures": [str(f) for f in figures]})
    return figures
