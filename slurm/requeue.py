"""SLURM's requeue signal and session bookkeeping for train.py; the standard library only (and the run
folder's names, normgeo.run_folder, which is too), so that train.py can have the USR1 handler before its
slow imports (Python dies of a USR1 it has no handler for): the process's signal owner (normgeo.signals)
hands USR1 to :class:`SlurmRequeue`.

:class:`callbacks.signal_stop.StopOnSignal` is the training side: it stops every rank at the next
optimizer-step boundary once :class:`SlurmRequeue` has recorded the signal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from normgeo.run_folder import RunFolder

# How summary.json's session_log says a session ended to requeue (normgeo.readers.run_states reads it).
REQUEUED = "requeue"


class SlurmRequeue:
    """SLURM's USR1 (``--signal=USR1@lead`` before the time limit, preemption, ``scancel --signal=USR1``):
    save the run, requeue the job, exit.

    Python dies of a USR1 it has no handler for, so this handler goes in before the slow imports. Once
    training runs it only records the signal: :class:`callbacks.signal_stop.StopOnSignal` stops all ranks at
    the next optimizer-step boundary, ``last.ckpt`` is written and train.py requeues the job. Before training
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
    job = (
        f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
        if array_job
        else os.environ.get("SLURM_JOB_ID")
    )
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


def under_slurm() -> bool:
    """This process is a SLURM task (srun/sbatch), not an interactive allocation's shell:
    SLURMEnvironment.detect()'s rule."""
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def record_slurm_job(run_dir: Path) -> None:
    """One line per SLURM session of the run (job id, restart count, start, node) for
    normgeo.readers.run_states."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_PROCID", "0") != "0":
        return
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    line = f"{job}\t{os.environ.get('SLURM_RESTART_COUNT', '0')}\t{started}\t{os.uname().nodename}\n"
    with open(RunFolder(run_dir).slurm_jobs, "a") as handle:
        handle.write(line)
