"""Whether a train.py session may continue or start the run in its run directory: the resume decisions
(which checkpoint, refused when the directory holds a run or a resume would change the experiment), made
before anything is written (normgeo.runs.start runs them before the run writes ``.hydra/`` or ``train.log``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from corpus.atomic import TMP_SUFFIX, DiskFullError, full_disk_cause
from corpus.refusal import Refusal
from models.divergence import NonFiniteError
from normgeo.config.schema import TrainSchema
from normgeo.measure.records import DamagedRecords
from normgeo.run_folder import (
    HYDRA_DIR,
    LAST_CHECKPOINT,
    LOCK_FILE,
    REPLACED_DIR,
    SUMMARY_FILE,
    TRAIN_LOG,
    RunFolder,
)
from normgeo.runs.run_config import (
    config_changes,
    is_rank_zero,
    load_run_config,
    read_checkpoint,
    resolved_run_config,
    verify_run_config,
)
from normgeo.runs.summary import read_summary, write_summary

log = logging.getLogger(__name__)


class RunDirectoryError(Refusal, RuntimeError):
    """The run directory holds an earlier run and no resume was asked for."""


class RunFinished(Exception):
    """A resume with nothing to train (train.py says so, exit 0); ``figures_left``: the run's end was
    interrupted after its summary, and train.py draws its figures."""

    def __init__(self, message: str, figures_left: bool = False) -> None:
        super().__init__(message)
        self.figures_left = figures_left


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    full_state: bool  # optimizer states and loop positions: what a resume needs (not weights only)


def checkpoint_info(path: Path) -> CheckpointInfo | str:
    """Step and kind of a checkpoint, or why it cannot be read."""
    try:
        ckpt = read_checkpoint(path)
        return CheckpointInfo(int(ckpt["global_step"]), "optimizer_states" in ckpt)
    except Exception as err:  # torch raises RuntimeError, EOFError, pickle errors... for damaged files
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def newest_resumable(run_dir: Path) -> tuple[Path | None, int | None, list[str]]:
    """The one rule for "the newest resumable checkpoint" (resume=auto, normgeo.readers.run_states): the first
    readable full-state candidate (last.ckpt, then the scheduled step-*.ckpt newest first, full state with
    keep_optimizer), its step, and why each newer candidate was passed over."""
    folder = RunFolder(run_dir)
    last = folder.last_checkpoint
    passed_over: list[str] = []
    scheduled = list(reversed(folder.scheduled_checkpoints().values()))
    for path in ([last] if last.exists() else []) + scheduled:
        info = checkpoint_info(path)
        if isinstance(info, CheckpointInfo) and info.full_state:
            return path, info.step, passed_over
        if isinstance(info, str):
            passed_over.append(f"{path} is unreadable ({info})")
    return None, None, passed_over


def resume_checkpoint(run_dir: Path, resume: str | None) -> str | None:
    """The checkpoint to continue from: the newest readable full-state one (:func:`newest_resumable`)."""
    if resume is None:
        if RunFolder(run_dir).last_checkpoint.exists():
            raise RunDirectoryError(
                f"{run_dir} already holds a run ({LAST_CHECKPOINT}). Continue it with resume=auto, "
                "or start another with a different run_name=... or seed=...")
        return None
    if resume == "auto":
        path, step, passed_over = newest_resumable(run_dir)
        if passed_over and path is None:
            raise RunDirectoryError(f"{passed_over[0]} and no other full-state checkpoint is readable: "
                                    "nothing to resume from. Start the run again under another run_name=..., "
                                    "or delete the damaged file to start it here.")
        if path is None and is_rank_zero() and (traces := run_traces(run_dir)) and not slurm_requeued():
            # A run killed before its first checkpoint, or one whose checkpoints were deleted: training it
            # again from step 0 here would write over its logs. A requeued SLURM job restarts its own run; the
            # other ranks of a start (srun's tasks, DDP's processes) see rank 0's fresh files and follow it.
            raise RunDirectoryError(
                f"{run_dir} holds an earlier run ({', '.join(traces[:3])}{', ...' if len(traces) > 3 else ''}"
                ") but no checkpoint to resume from: nothing to resume, and its files stay as they are. "
                f"Start it fresh elsewhere: {fresh_command(run_dir)} (or delete {run_dir} to start it there)")
        for reason in passed_over:
            log.warning("resume=auto: %s; falling back to %s (step %s)", reason, path, step)
        return str(path) if path else None
    if not Path(resume).is_file():
        raise RunDirectoryError(f"resume={resume!r}: no such checkpoint file "
                                "(use resume=auto or a .ckpt path)")
    info = checkpoint_info(Path(resume))
    if isinstance(info, str):
        raise RunDirectoryError(f"resume={resume!r}: unreadable checkpoint ({info}); use resume=auto")
    if not info.full_state:
        raise RunDirectoryError(
            f"resume={resume!r} holds weights only (a scheduled checkpoint, checkpoint.keep_optimizer=false),"
            " not the optimizer state a resume needs: resume the run from its last.ckpt with resume=auto, or "
            f"study these weights with: python analyze.py model=checkpoint model.checkpoint={resume}")
    return resume


def replace_diverged_run(run_dir: Path) -> bool:
    """Move a diverged run's files aside into :data:`REPLACED_DIR` (True if there was one): the start deletes
    them at its first optimizer step, or moves them back when it fails before it (normgeo.runs.start)."""
    record = divergence(run_dir)
    if record is None:
        return False
    aside = RunFolder(run_dir).replaced
    shutil.rmtree(aside, ignore_errors=True)  # left by a start that was killed while it replaced a run
    aside.mkdir()
    for path in run_dir.iterdir():
        if path.name not in KEPT_ON_REPLACE:
            path.rename(aside / path.name)
    log.warning("replaced the run that diverged at step %s (optim.lr=%s) in %s",
                record.get("step"), record.get("lr"), run_dir)
    return True


def run_traces(run_dir: Path) -> list[str]:
    """The names an earlier session left in ``run_dir``, sorted, but the lock and killed writes' temporaries.
    In a launch of several processes (srun's tasks, torchrun's or Lightning's ranks) the log is not counted:
    the other ranks open it as they start, and an earlier run left more (rank 0 writes ``.hydra/`` first)."""
    if not run_dir.is_dir():
        return []
    together = int(os.environ.get("SLURM_NTASKS") or 1) > 1 or int(os.environ.get("WORLD_SIZE") or 1) > 1
    ignored = {LOCK_FILE, TRAIN_LOG} if together else {LOCK_FILE}
    return sorted(p.name for p in run_dir.iterdir()
                  if p.name not in ignored and not p.name.endswith(TMP_SUFFIX))


def fresh_command(run_dir: Path) -> str:
    """This session's command line without ``resume``, in the first free folder beside ``run_dir``."""
    number = 2
    while (free := run_dir.with_name(f"{run_dir.name}-{number}")).exists():
        number += 1
    return pinned_command(free)


def finished_by_its_summary(run_dir: Path, cfg: TrainSchema) -> int | None:
    """The step at which the run's readable summary says it finished this session's max_steps, else None."""
    try:
        summary = read_summary(run_dir)
    except DamagedRecords:
        return None
    finished = summary.get("finished") is True and summary.get("step") == summary.get("max_steps")
    return cfg.max_steps if finished and summary.get("max_steps") == cfg.max_steps else None


def finished_message(ckpt_path: str, cfg: TrainSchema) -> str | None:
    """The one line for a resume whose checkpoint reached the step this session trains to, else None."""
    info = checkpoint_info(Path(ckpt_path))
    target = min(int(cfg.stop_at_step or cfg.max_steps), int(cfg.max_steps))
    if not isinstance(info, CheckpointInfo) or info.step < target:
        return None
    if target < int(cfg.max_steps):
        return (f"{cfg.run_dir}: already at step {info.step} (stop_at_step={cfg.stop_at_step}); "
                f"nothing to do: raise stop_at_step or drop it to train on to max_steps={cfg.max_steps}")
    return f"{cfg.run_dir}: already finished at step {info.step}; nothing to do"


def slurm_requeued() -> bool:
    """This process is a SLURM job that was requeued (preemption, time limit): it continues its own run."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


# summary.json's record of a run whose training loss became inf/NaN (train.py writes it)
DIVERGED = "diverged"
# What a start that replaces a diverged run keeps: this session's own lock and Hydra files.
KEPT_ON_REPLACE = (LOCK_FILE, HYDRA_DIR, TRAIN_LOG, REPLACED_DIR)


def divergence(run_dir: Path) -> dict[str, Any] | None:
    """The divergence record of the run in ``run_dir`` (step, loss, optim.lr), None if it did not diverge."""
    try:
        summary = read_summary(run_dir)
    except DamagedRecords:  # unreadable: no record of a divergence (its readers name the damage)
        return None
    record = summary.get(DIVERGED)
    return record if isinstance(record, dict) else None


def mark_diverged(run_dir: Path, summary: dict[str, Any] | None, err: NonFiniteError) -> NonFiniteError:
    """A run that diverged: its session's ``summary`` (rank 0's; None on the other ranks) written with the
    record :func:`divergence` reads, and the error that says so and how a corrected command replaces it."""
    if summary is not None:
        write_summary(run_dir, {**summary, DIVERGED: {"step": err.step, "loss": str(err.loss), "lr": err.lr}})
    return NonFiniteError(err.what, step=err.step, loss=err.loss, lr=err.lr,
                          then=f"{run_dir} is marked {DIVERGED} in {SUMMARY_FILE}, and the same command with "
                               "a lower optim.lr replaces it")


def check_diverged_start(cfg: TrainSchema, run_dir: Path, record: dict[str, Any], resume: str | None) -> None:
    """The rule for a folder whose run diverged: a fresh start (resume=null) with a changed config replaces
    it; the same config, or a resume, would only diverge again: refused, naming the command that works."""
    saved = load_run_config(run_dir)
    changed = saved is None or bool(config_changes(saved, resolved_run_config(cfg)))
    if resume is None and changed:
        return
    lr = record.get("lr")
    suggestion = this_command(drop=("resume", "optim.lr"),
                              add=[f"optim.lr={lr / 10:g}" if isinstance(lr, float) else "optim.lr=..."])
    raise RunDirectoryError(
        f"{run_dir} holds a run that diverged at step {record.get('step')} (optim.lr={lr}); "
        f"{'a resume' if resume is not None else 'the same config'} would diverge again. Start it afresh "
        f"with a lower learning rate (the diverged run is then replaced): {suggestion}")


def session_checkpoint(cfg: TrainSchema) -> str | None:
    """The checkpoint this session continues from, or a Refusal; reads, never writes. A folder
    whose run diverged is replaced by a fresh start with a changed config (check_diverged_start)."""
    resume = cfg.resume
    if resume is None and slurm_requeued():
        resume = "auto"  # a requeued job continues its own run, whatever its command line says
    run_dir = Path(cfg.run_dir)
    if (record := divergence(run_dir)) is not None:
        check_diverged_start(cfg, run_dir, record, resume)
        if resume is None:
            return None  # replaces the diverged run: nothing of it is compared or continued
    try:
        ckpt_path = resume_checkpoint(run_dir, resume)
    except RunDirectoryError as err:
        if resume == "auto" and (step := finished_by_its_summary(run_dir, cfg)) is not None:
            # Its checkpoints damaged or deleted (to save space): a finished run is still finished, as status
            # says, not a run to start again.
            raise RunFinished(
                f"{run_dir}: already finished at step {step}, as its summary.json says; nothing to do (it "
                f"has no readable full-state checkpoint: restore {RunFolder(run_dir).last_checkpoint} from a "
                "copy to train it further or export it)") from err
        raise
    verify_run_config(run_dir, ckpt_path, resolved_run_config(cfg))
    if ckpt_path and not Path(ckpt_path).resolve().is_relative_to(run_dir.resolve()):
        info = checkpoint_info(Path(ckpt_path))
        if isinstance(info, CheckpointInfo) and info.step >= int(cfg.max_steps):
            raise RunFinished(f"{run_dir}: resume={ckpt_path} is another run's checkpoint at step "
                              f"{info.step}, max_steps={cfg.max_steps}: nothing to train here; raise "
                              "max_steps to train on")
        log.warning("resume=%s is another run's checkpoint: %s continues it from its step, and its records "
                    "begin there (the earlier steps are that run's)", ckpt_path, run_dir)
    elif ckpt_path and (done := finished_message(ckpt_path, cfg)):
        # A resume never retrains a finished run nor rewrites its logs; it draws what its end left undrawn.
        try:
            summary = read_summary(run_dir)
        except DamagedRecords as err:  # the run is finished whatever its summary says; its figures stay
            log.warning("%s; the run is finished (its checkpoint says so)", err)
            summary = {}
        left = (cfg.probe.enabled and cfg.probe.figures and summary.get("finished") is True
                and not summary.get("figures") and RunFolder(run_dir).angles.is_file())
        if left:
            done = f"{done}; its end was interrupted before the figures: drawing them (nothing is retrained)"
        raise RunFinished(done, figures_left=left)
    return ckpt_path


def continue_command(cfg: TrainSchema) -> str:
    """The one command printed to go on with this run, from what its folder holds now: this session's
    command line with ``run_dir`` pinned (another day's default paths may differ), and ``resume=auto`` where
    a checkpoint is there to continue from (else the run starts again: resume=auto would be refused)."""
    resume = ["resume=auto"] if newest_resumable(Path(cfg.run_dir))[0] is not None else []
    return pinned_command(cfg.run_dir, *resume)


def pinned_command(run_dir: str | Path, *add: str) -> str:
    """This command line with ``run_dir`` pinned (quoted where Hydra's grammar needs it), ``resume`` out (a
    resume command sets it itself), and ``add``."""
    value = str(run_dir)
    if not re.fullmatch(r"[\w/.:@%+-]+", value):
        value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return this_command(drop=("run_dir", "resume"), add=[f"run_dir={value}", *add])


def this_command(drop: tuple[str, ...], add: list[str]) -> str:
    """This command line (one job's overrides in a ``-m`` sweep), ``drop``'s keys out, ``add`` in."""
    overrides = (list(HydraConfig.get().overrides.task) if HydraConfig.initialized()
                 else [a for a in sys.argv[1:] if a not in ("-m", "--multirun")])
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("~+") not in drop]
    return shlex.join([*_program(), *kept, *add])


def _program() -> list[str]:
    """How this process was started: ``python train.py``, or a console script (normgeo-train); the program by
    its bare name where that name on PATH is this one."""
    script = sys.argv[0]
    program, *rest = [sys.executable, script] if script.endswith(".py") else [script]
    found = shutil.which(os.path.basename(program))
    if found and os.path.abspath(found) == os.path.abspath(program):
        program = os.path.basename(program)
    return [program, *rest]


class RunDiskFullError(Refusal, RuntimeError):
    """The run's disk filled up while it trained: the file, the space left and how to continue."""


def disk_full_refusal(err: BaseException, cfg: TrainSchema) -> RunDiskFullError | None:
    """``err`` as one line that says which write found the disk full and how to continue, when a full disk
    is behind it (torch.save wraps the OSError into a RuntimeError; Lightning may add its own on top)."""
    cause = full_disk_cause(err)
    if cause is None:
        return None
    run_dir = Path(cfg.run_dir)
    where = Path(cause.filename) if cause.filename else run_dir  # a write() names no file: the run's disk
    existing = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    path, step, _ = newest_resumable(run_dir)
    how = (f"continue from {path.name} (step {step}, intact) with resume=auto" if path
           else "start it again (no checkpoint was saved yet)")
    removed = "; its partial file was removed" if isinstance(cause, DiskFullError) else ""  # atomic_open's
    return RunDiskFullError(
        f"{cause.strerror or 'No space left on device'} writing {where} ({free / 2**20:.0f} MiB free there"
        f"{removed}): free space on that disk, then {how}: {continue_command(cfg)}")
