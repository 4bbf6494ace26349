"""SLURM for train.py: requeue this job, whether this process is a SLURM task, and the session bookkeeping;
the standard library only (and the run folder's names, normgeo.run_folder, which is too), so that
normgeo.signals, whose table says what SLURM's USR1 does, can be imported before train.py's slow imports.
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
