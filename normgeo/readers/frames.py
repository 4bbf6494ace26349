"""A run's or a sweep's records and logged metrics as DataFrames, for a notebook: ``normgeo.load_run(folder)``
and ``normgeo.load_sweep(folder)``.

Every file is read by its one reader, the tools' (records:
:func:`normgeo.measure.run_records.read_record_file`; metrics, config, summary: :mod:`normgeo.readers`), and
by their rule: a damaged file is named (a warning, and in ``damaged``) and left out, and the rest is read;
nothing raises for a damaged file. Where the tools leave a damaged run out of a figure, a notebook still
gets the run's other files.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from normgeo.measure.records import DamagedRecords
from normgeo.measure.run_records import read_record_file
from normgeo.readers.identity import identity_from_config, read_run_config
from normgeo.readers.metrics_csv import COLUMNS, read_metrics
from normgeo.readers.run_states import find_runs
from normgeo.run_folder import (
    ANGLES_FILE,
    ELLIPSOID_FILE,
    ENERGY_FILE,
    INTERVENTION_FILE,
    INTERVENTION_POSITIONS_FILE,
    MEAN_SOURCES_FILE,
    NULL_FILE,
    RECORD_FILES,
)
from normgeo.runs.summary import read_summary

# The records files as DataFrames: the name a frame is asked for by (the file's name without .jsonl).
FRAMES = {"angles": ANGLES_FILE, "null": NULL_FILE, "energy": ENERGY_FILE, "mean_sources": MEAN_SOURCES_FILE,
          "intervention": INTERVENTION_FILE, "intervention_positions": INTERVENTION_POSITIONS_FILE,
          "ellipsoid": ELLIPSOID_FILE}


class RecordFrames:
    """The records files of ``files`` (file name -> its records) as DataFrames, their columns the records'
    fields; an unmeasured or damaged file gives an empty one."""

    files: dict[str, list[dict]]

    def frame(self, name: str) -> pd.DataFrame:
        """The records of ``name``, a key of :data:`FRAMES` (``intervention_positions``, ``ellipsoid``)."""
        return pd.DataFrame(self.files.get(FRAMES[name], []))

    @property
    def angles(self) -> pd.DataFrame:
        return self.frame("angles")

    @property
    def null(self) -> pd.DataFrame:
        return self.frame("null")

    @property
    def energy(self) -> pd.DataFrame:
        return self.frame("energy")

    @property
    def mean_sources(self) -> pd.DataFrame:
        return self.frame("mean_sources")

    @property
    def intervention(self) -> pd.DataFrame:
        return self.frame("intervention")


@dataclass
class Run(RecordFrames):
    """One run's (or analysis's) files: the records, ``metrics`` (step, metric, value of every session),
    ``config`` and ``summary`` (summary.json), and the damaged files left out."""

    folder: Path
    files: dict[str, list[dict]]
    metrics: pd.DataFrame
    config: dict
    summary: dict
    damaged: list[DamagedRecords] = field(default_factory=list)


Read = TypeVar("Read")


def read_or_name(reader: Callable[[], Read], empty: Read, damaged: list[DamagedRecords]) -> Read:
    """``reader()``, or, for a damaged file, ``empty`` with the file named (a warning and ``damaged``)."""
    try:
        return reader()
    except DamagedRecords as err:
        warnings.warn(f"left out {err}", stacklevel=3)
        damaged.append(err)
        return empty


def load_run(folder: str | Path) -> Run:
    """Every records file, the logged metrics, the config and summary of the run (or analyze.py output) in
    ``folder``; a damaged file is named and left out. FileNotFoundError when ``folder`` is not a folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such run folder")
    damaged: list[DamagedRecords] = []
    config = read_or_name(lambda: read_run_config(folder), {}, damaged)
    angles = read_or_name(lambda: read_record_file(folder, ANGLES_FILE, config=config), [], damaged)
    files = {name: angles if name == ANGLES_FILE
             else read_or_name(lambda name=name: read_record_file(folder, name, angles, config), [], damaged)
             for name in RECORD_FILES}
    return Run(folder=folder, files=files,
               metrics=read_or_name(lambda: read_metrics(folder), pd.DataFrame(columns=COLUMNS), damaged),
               config=config,
               summary=read_or_name(lambda: read_summary(folder), {}, damaged), damaged=damaged)


@dataclass
class Sweep(RecordFrames):
    """The runs under a folder: their records and ``metrics`` with the run's ``run`` (its folder, relative to
    the sweep's), ``runs`` (run, norm, placement, size, seed, folder), each :class:`Run` in ``by_run``, and
    every damaged file left out."""

    folder: Path
    by_run: dict[str, Run]
    files: dict[str, list[dict]]
    metrics: pd.DataFrame
    runs: pd.DataFrame
    damaged: list[DamagedRecords] = field(default_factory=list)


def load_sweep(folder: str | Path) -> Sweep:
    """Every run at or below ``folder`` (:func:`normgeo.readers.run_states.find_runs`) by :func:`load_run`; a
    damaged file is named and left out. FileNotFoundError when no run is found."""
    folder = Path(folder)
    found = list(find_runs(folder)) if folder.is_dir() else []
    if not found:
        raise FileNotFoundError(f"{folder}: no run folder (with .hydra/config.yaml) at or below it")
    by_run = {str(run_dir.relative_to(folder)): load_run(run_dir) for run_dir in found}
    files = {name: [{**row, "run": run} for run, loaded in by_run.items() for row in loaded.files[name]]
             for name in RECORD_FILES}
    metrics = [loaded.metrics.assign(run=run) for run, loaded in by_run.items() if not loaded.metrics.empty]
    return Sweep(
        folder=folder, by_run=by_run, files=files,
        metrics=pd.concat(metrics, ignore_index=True) if metrics else pd.DataFrame(columns=[*COLUMNS, "run"]),
        runs=pd.DataFrame([run_row(run, loaded) for run, loaded in by_run.items()]),
        damaged=[err for loaded in by_run.values() for err in loaded.damaged])


def run_row(run: str, loaded: Run) -> dict[str, Any]:
    """A run's row of :attr:`Sweep.runs`: its arm keys as every reader reads them (identity_from_config)."""
    norm = loaded.files[ANGLES_FILE][0]["norm"] if loaded.files[ANGLES_FILE] else None
    identity = identity_from_config(loaded.config, norm)
    return {"run": run, "norm": identity.norm, "placement": identity.placement, "size": identity.size,
            "seed": identity.seed, "folder": str(loaded.folder)}
