"""What state each run is in, from its files and SLURM (shown by :mod:`normgeo.status`)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import normgeo.config.compose  # noqa: F401  (registers the resolvers the config uses)
from normgeo.measure.records import DamagedRecords
from normgeo.measure.run_records import read_run_records, whole
from normgeo.readers.identity import read_run_config
from normgeo.readers.metrics_csv import last_value, read_metrics
from normgeo.run_folder import ANGLES_FILE, CHECKPOINTS_DIR, CSV_DIR, FIGURES_DIR, HYDRA_DIR, RunFolder
from normgeo.runs.session import divergence, newest_resumable
from normgeo.runs.summary import read_summary
from slurm.requeue import REQUEUED

ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING"}
WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "PREEMPTED"}
# A run's own folders, and the loggers' (wandb's, TensorBoard's, Lightning's default), are not searched.
SKIP_DIRS = {CHECKPOINTS_DIR, CSV_DIR, FIGURES_DIR, HYDRA_DIR, ".submitit", "wandb", "tensorboard",
             "lightning_logs"}


@dataclass
class RunStatus:
    run: str
    state: str
    step: int | None
    max_steps: int | None
    loss: float | None
    probe_step: int | str | None
    slurm_job: str | None
    slurm_state: str | None
    updated_s_ago: float | None
    # a records file that cannot be read (file:line): the probe column says damaged
    damaged: str | None = None


def find_runs(root: Path) -> Iterator[Path]:
    """Run directories at or below ``root`` (a run's own subfolders are not searched)."""
    if RunFolder(root).holds_run:
        yield root
        return
    for path, dirs, _ in os.walk(root):
        here = Path(path)
        if here != root and RunFolder(here).holds_run:
            dirs.clear()
            yield here
            continue
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)


def is_analysis(run_dir: Path) -> bool:
    """An analyze.py output folder (its config has ``out_dir`` and no ``max_steps``), not a training run."""
    try:
        cfg = OmegaConf.load(RunFolder(run_dir).hydra_config)
    except Exception:
        return False
    return "out_dir" in cfg and "max_steps" not in cfg


def run_config(run_dir: Path) -> tuple[int | None, int | None]:
    """(max_steps, stop_at_step) from the run's config (the one reader: raises DamagedRecords naming a damaged
    file); None where it holds no whole number."""
    config = read_run_config(run_dir)
    return whole(config.get("max_steps")), whole(config.get("stop_at_step")) or None


def checkpoint_step(run_dir: Path) -> int | None:
    """Step of the checkpoint resume=auto would continue from (normgeo.runs.session.newest_resumable), else
    of the newest scheduled checkpoint."""
    path, step, _ = newest_resumable(run_dir)
    if path is not None:
        return step
    return max(RunFolder(run_dir).scheduled_checkpoints(), default=None)


def last_loss(run_dir: Path) -> float | None:
    """The train/loss of the highest logged step, from the CSV every run writes (normgeo.readers.metrics_csv);
    raises DamagedRecords naming a damaged metrics.csv."""
    return last_value(read_metrics(run_dir), "train/loss")


def last_probe_step(run_dir: Path) -> int | str | None:
    """The newest probed step; "pretrained" when the only records are of a published model (step null)."""
    try:
        config = read_run_config(run_dir)
    except DamagedRecords:  # named by run_config's read; the records are still checked for their shape
        config = {}
    steps = {row.get("step") for row in read_run_records(run_dir, config)[ANGLES_FILE]}  # raises Damaged...
    trained = [s for s in steps if s is not None]
    return max(trained) if trained else ("pretrained" if steps else None)


def slurm_job(run_dir: Path) -> str | None:
    """The job id of the run's latest SLURM session."""
    path = RunFolder(run_dir).slurm_jobs
    if not path.is_file():
        return None
    lines = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return lines[-1][0] if lines else None


def slurm_state(job: str) -> str | None:
    """squeue's state while SLURM remembers the job, else sacct's (accounting on), else None."""
    for command in (["squeue", "-h", "--states=all", "-j", job, "-o", "%T"],
                    ["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"]):
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        states = out.stdout.split() if out.returncode == 0 else []
        if states:
            return states[-1].split()[0].rstrip("+")  # "CANCELLED by 0" -> CANCELLED
    return None


def asked_to_requeue(summary: dict) -> bool:
    """True when the run's summary says its latest session stopped to requeue (the last entry of its
    ``session_log``, which train.py writes before it requeues the job)."""
    sessions = summary.get("session_log")
    latest = sessions[-1] if isinstance(sessions, list) and sessions else None
    return isinstance(latest, dict) and latest.get("ended") == REQUEUED


def newest_mtime(run_dir: Path) -> float | None:
    newest = None
    for path, _, files in os.walk(run_dir):
        for name in files:
            try:
                mtime = os.stat(os.path.join(path, name)).st_mtime
            except OSError:  # replaced while walking (atomic writes)
                continue
            newest = mtime if newest is None else max(newest, mtime)
    return newest


def infer_state(*, step: int | None, max_steps: int | None, stop_at_step: int | None, slurm: str | None,
                requeue_logged: bool, updated_s_ago: float | None, active_s: float) -> str:
    if step is not None and max_steps is not None and step >= max_steps:
        return "finished"
    if slurm in ACTIVE:
        return "running"
    if slurm in WAITING:
        return "preempted"  # requeued (or preempted) and waiting to continue
    if slurm is None and updated_s_ago is not None and updated_s_ago < active_s:
        return "running"  # no scheduler to ask: a file changed recently
    if requeue_logged:
        return "preempted"
    if stop_at_step is not None and step is not None and step >= stop_at_step:
        return "stopped"
    return "failed"


def finished_by_summary(summary: dict) -> int | None:
    """The last step of a run whose summary says it finished, else None."""
    return summary["step"] if summary.get("finished") is True and "step" in summary else None


def run_status(run_dir: Path, root: Path, *, use_slurm: bool = True, active_s: float = 900.0) -> RunStatus:
    """The run's state from its files (and SLURM). A damaged file (records, config, summary.json,
    metrics.csv: each through its one reader) is this run's problem, not the whole listing's: what it
    would have said is shown as unknown ("-", the state ``unknown``) and ``damaged`` names each such file."""
    name = str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
    problems: list[str] = []

    def read(reader: Callable[[Path], Any], unknown: Any) -> Any:
        try:
            return reader(run_dir)
        except DamagedRecords as err:
            problems.append(str(err))
            return unknown

    probe_step = read(last_probe_step, "damaged")
    if is_analysis(run_dir):
        return RunStatus(name, "analyzed", None, None, None, probe_step, None, None, None,
                         "; ".join(problems) or None)
    known = len(problems)
    max_steps, stop_at_step = read(run_config, (None, None))
    config_damaged = len(problems) > known
    # the one summary reader, normgeo.readers.identity, not normgeo.runs.summary, which imports Lightning:
    # status stays quick; a damaged summary.json is named in ``problems``
    summary = read(read_summary, {})
    summary_damaged = len(problems) > known + config_damaged
    finished_step = finished_by_summary(summary)
    if config_damaged and isinstance(summary.get("max_steps"), int):
        max_steps = summary["max_steps"]  # the run's own account of its length (it was "running 6/?")
    loss = read(last_loss, None)
    step = checkpoint_step(run_dir)
    job = slurm_job(run_dir)
    state_from_slurm = slurm_state(job) if (job and use_slurm) else None
    mtime = newest_mtime(run_dir)
    updated = None if mtime is None else max(0.0, time.time() - mtime)
    state = infer_state(step=step, max_steps=max_steps, stop_at_step=stop_at_step, slurm=state_from_slurm,
                        requeue_logged=asked_to_requeue(summary), updated_s_ago=updated, active_s=active_s)
    if state == "failed":
        state = "diverged" if divergence(run_dir) is not None else state  # its summary says so (train.py)
    if step is None and finished_step is not None:
        state, step = "finished", finished_step  # its checkpoints deleted since (to save space)
    elif (summary_damaged or config_damaged) and state != "finished" and state_from_slurm is None:
        state = "unknown"  # a recent file change is no sign of running when the run's own account is damaged
    return RunStatus(run=name, state=state, step=step, max_steps=max_steps, loss=loss, probe_step=probe_step,
                     slurm_job=job, slurm_state=state_from_slurm,
                     updated_s_ago=None if updated is None else round(updated, 1),
                     damaged="; ".join(problems) or None)
