"""The one owner of a run folder's names: every file and folder a training run (or an analysis) holds, and the
scheduled checkpoint's name, formatted and parsed here only.

Every writer and reader (train.py, analyze.py, the callbacks, normgeo.runs, the readers, the figures, the
commands, slurm/) asks :class:`RunFolder` or these names; the standard library only, beside normgeo.paths,
so that any of them imports it without a circle (tests/test_layout.py, tests/test_run_folder.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RUN_CONFIG_FILE = "run_config.yaml"  # train.py's record of the run's config, checked on resume
RUN_INFO_FILE = "run_info.json"  # analyze.py's record of what it measured, written last
SUMMARY_FILE = "summary.json"  # the run's summary, written by train.py at the end of each session
PLAN_FILE = "plan.json"  # the plan the pre-flight check kept (normgeo.runs.preflight)
LOCK_FILE = ".normgeo.lock"  # one training process per run folder (normgeo.runs.lock)
TRAIN_LOG = "train.log"  # the run's log (Hydra's job log, train.py's job name): every rank appends to it
HYDRA_DIR = ".hydra"  # Hydra's record of the composed config, written once a start is accepted
HYDRA_CONFIG = f"{HYDRA_DIR}/config.yaml"  # the composed config: what marks a run folder (normgeo.status)
HYDRA_FILES = (HYDRA_CONFIG, f"{HYDRA_DIR}/hydra.yaml", f"{HYDRA_DIR}/overrides.yaml")  # as Hydra names them
CHECKPOINTS_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"  # in checkpoints/: the full state to resume from
CSV_DIR = "csv"  # Lightning's CSVLogger(save_dir=run_dir, name=CSV_DIR): csv/version_<n>/metrics.csv
METRICS_FILE = "metrics.csv"
FIGURES_DIR = "figures"  # a run's own figures: train.py's at the end, normgeo.report's by default
WANDB_ID_FILE = "wandb_run_id.txt"  # the same wandb run across resumes
SLURM_JOBS_FILE = "slurm_jobs.tsv"  # one line per SLURM session (slurm.requeue.record_slurm_job)
REPLACED_DIR = ".replaced-run"  # a diverged run moved aside while a corrected start replaces it
EVAL_FILE = "eval.json"  # normgeo.evaluate's downstream scores
REFERENCES_FILE = "probe_references.npz"  # the probe's reference directions, saved once

# The probe's records, one JSON row per line.
ANGLES_FILE = "angles.jsonl"
NULL_FILE = "null.jsonl"
ENERGY_FILE = "energy.jsonl"
ELLIPSOID_FILE = "ellipsoid.jsonl"
INTERVENTION_FILE = "intervention.jsonl"
INTERVENTION_POSITIONS_FILE = "intervention_positions.jsonl"
MEAN_SOURCES_FILE = "mean_sources.jsonl"
RECORD_FILES = (ANGLES_FILE, NULL_FILE, ENERGY_FILE, ELLIPSOID_FILE, INTERVENTION_FILE,
                INTERVENTION_POSITIONS_FILE, MEAN_SOURCES_FILE)

# A scheduled checkpoint: checkpoints/step-0000100.ckpt (seven digits, so that names sort by step).
CHECKPOINT_PATTERN = re.compile(r"step-(\d+)\.ckpt")
CHECKPOINT_GLOB = "step-*.ckpt"  # how a message names them all


def checkpoint_name(step: int) -> str:
    """The file name of the scheduled checkpoint of ``step`` (:func:`checkpoint_step` reads it)."""
    return f"step-{step:07d}.ckpt"


def checkpoint_step(name: str) -> int | None:
    """The step a scheduled checkpoint's file name says (:func:`checkpoint_name`), None for any other name."""
    match = CHECKPOINT_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


class Entry:
    """A file or folder of a run: ``RunFolder(run_dir).summary`` is ``run_dir / SUMMARY_FILE``."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def __get__(self, folder: RunFolder, owner: type) -> Path:
        return folder.path.joinpath(*self.names)


class RunFolder:
    """A run folder's files and folders by what they hold (``RunFolder(run_dir).summary``)."""

    run_config = Entry(RUN_CONFIG_FILE)
    run_info = Entry(RUN_INFO_FILE)
    summary = Entry(SUMMARY_FILE)
    plan = Entry(PLAN_FILE)
    lock = Entry(LOCK_FILE)
    train_log = Entry(TRAIN_LOG)
    hydra = Entry(HYDRA_DIR)
    hydra_config = Entry(HYDRA_CONFIG)
    checkpoints = Entry(CHECKPOINTS_DIR)
    last_checkpoint = Entry(CHECKPOINTS_DIR, LAST_CHECKPOINT)
    csv = Entry(CSV_DIR)
    figures = Entry(FIGURES_DIR)
    wandb_id = Entry(WANDB_ID_FILE)
    slurm_jobs = Entry(SLURM_JOBS_FILE)
    replaced = Entry(REPLACED_DIR)
    eval = Entry(EVAL_FILE)
    references = Entry(REFERENCES_FILE)
    angles = Entry(ANGLES_FILE)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def holds_run(self) -> bool:
        """Whether this is a run's folder: train.py's record of its config, or the config Hydra composed (an
        analysis's, or a run that has not recorded its own yet); how the readers find runs."""
        return self.run_config.is_file() or self.hydra_config.is_file()

    def checkpoint(self, step: int) -> Path:
        """The scheduled checkpoint of ``step`` (there or not)."""
        return self.checkpoints / checkpoint_name(step)

    def scheduled_checkpoints(self) -> dict[int, Path]:
        """The scheduled checkpoints on disk by optimizer step, lowest first."""
        if not self.checkpoints.is_dir():
            return {}
        found = {step: path for path in self.checkpoints.iterdir()
                 if (step := checkpoint_step(path.name)) is not None}
        return dict(sorted(found.items()))

    def record(self, name: str) -> Path:
        """One of the probe's records (:data:`RECORD_FILES`)."""
        if name not in RECORD_FILES:
            raise ValueError(f"{name} is not one of the probe's records {RECORD_FILES}")
        return self.path / name
