"""The one owner of a run folder's names: every file and folder a training run (or an analysis) holds, and the
scheduled checkpoint's name, formatted and parsed here only.

Every writer and reader (train.py, analyze.py, the callbacks, normgeo.runs, the readers, the figures, the
commands, slurm/) asks :class:`RunFolder` or these names; the standard library only, beside normgeo.paths,
so that any of them imports it without a circle (tests/test_layout.py, tests/test_run_folder.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RunFolder:
    """A run folder's files and folders by what they hold (``RunFolder(run_dir).summary``)."""

    path: Path

    def __init__(self, path: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "path", Path(path))

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def run_config(self) -> Path:
        return self.path / RUN_CONFIG_FILE

    @property
    def run_info(self) -> Path:
        return self.path / RUN_INFO_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def plan(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def lock(self) -> Path:
        return self.path / LOCK_FILE

    @property
    def train_log(self) -> Path:
        return self.path / TRAIN_LOG

    @property
    def hydra(self) -> Path:
        return self.path / HYDRA_DIR

    @property
    def hydra_config(self) -> Path:
        return self.path / HYDRA_CONFIG

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / LAST_CHECKPOINT

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

    @property
    def csv(self) -> Path:
        return self.path / CSV_DIR

    @property
    def figures(self) -> Path:
        return self.path / FIGURES_DIR

    @property
    def wandb_id(self) -> Path:
        return self.path / WANDB_ID_FILE

    @property
    def slurm_jobs(self) -> Path:
        return self.path / SLURM_JOBS_FILE

    @property
    def replaced(self) -> Path:
        return self.path / REPLACED_DIR

    @property
    def eval(self) -> Path:
        return self.path / EVAL_FILE

    @property
    def references(self) -> Path:
        return self.path / REFERENCES_FILE

    def record(self, name: str) -> Path:
        """One of the probe's records (:data:`RECORD_FILES`)."""
        if name not in RECORD_FILES:
            raise ValueError(f"{name} is not one of the probe's records {RECORD_FILES}")
        return self.path / name

    @property
    def angles(self) -> Path:
        return self.path / ANGLES_FILE

    @property
    def null(self) -> Path:
        return self.path / NULL_FILE
