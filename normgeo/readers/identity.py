"""Which run a folder holds: its arm keys (norm, placement, size) and seed, read the same way by every reader
of a sweep (``normgeo.compare``, ``normgeo.status``, ``normgeo.report`` and the verdict); and every file a run
holds (records, config, ``summary.json``, ``metrics.csv``) read by one reader per file
(:func:`read_run_files`), whose :class:`DamagedRecords` names the file, the line or key and what it expected.

Two folders with the same identity (a backup copy, two sweeps under one folder) are refused: every reader
exits 2 naming each folder on a line of its own, and reads nothing until one of them is moved out. Taking one
of the two would pair (or draw) a run that the user may not have meant, and which one is "newest" depends on
copies' modification times.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from corpus.refusal import Refusal
from normgeo.measure.records import DamagedRecords
from normgeo.measure.run_records import read_run_records
from normgeo.readers.metrics_csv import read_metrics
from normgeo.run_folder import HYDRA_CONFIG, RUN_CONFIG_FILE, RunFolder
from normgeo.runs.formats import recorded_value
from normgeo.runs.run_config import ALLOWED_CHANGES, config_changes
from normgeo.runs.summary import read_summary

CONFIG_FILES = (RUN_CONFIG_FILE, HYDRA_CONFIG)  # train.py's record first, else Hydra's


@dataclass(frozen=True)
class RunIdentity:
    """The keys that make a run one arm's one seed: two runs with equal identities are the same run."""

    norm: str | None
    placement: str
    size: str | None
    seed: int | None

    def __str__(self) -> str:
        return f"norm={self.norm} placement={self.placement} size={self.size} seed={self.seed}"


def read_run_config(run_dir: Path) -> dict:
    """The run's resolved config: run_config.yaml, else Hydra's config.yaml ({} when neither); raises
    :class:`DamagedRecords` naming the file when it is empty or not a YAML mapping."""
    for name in CONFIG_FILES:
        path = run_dir / name
        if path.is_file():
            try:
                config = yaml.safe_load(path.read_text(errors="replace"))
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                raise DamagedRecords(path, mark.line + 1 if mark else 1,
                                     f"not YAML: {getattr(err, 'problem', err)}") from None
            if config is None:
                raise DamagedRecords(path, 1, "empty: no setting in it",
                                     "copy it again from where the run wrote it")
            if not isinstance(config, dict):
                raise DamagedRecords(path, 1, f"a YAML {type(config).__name__}, not a mapping")
            if name == HYDRA_CONFIG and RunFolder(run_dir).summary.is_file():
                # train.py records its resolved config at every session's start; Hydra's is not (${size.lr})
                raise DamagedRecords(RunFolder(run_dir).run_config, 1, "absent, while summary.json says the "
                                     "run trained", "copy it again from where the run wrote it")
            return config
    return {}


@dataclass
class RunFiles:
    """Every file of a run a reader needs, each read whole and checked by its one reader."""

    records: dict[str, list[dict]]  # records file name -> its records ([] when absent)
    config: dict  # run_config.yaml, else Hydra's config ({} when neither)
    summary: dict  # summary.json ({} when absent)
    metrics: pd.DataFrame  # step, metric, value of every session's metrics.csv


def read_run_files(run_dir: Path) -> RunFiles:
    """Every file of ``run_dir`` that ``compare`` and ``report`` read, read whole before anything is drawn;
    raises :class:`DamagedRecords` for the first damaged one (the reader skips the run and names it)."""
    try:
        config = read_run_config(run_dir)
        return RunFiles(records=read_run_records(run_dir, config), config=config,
                        summary=read_summary(run_dir), metrics=read_metrics(run_dir))
    except DamagedRecords as err:  # a metrics.csv lies two folders down: the skipped run is named, not them
        err.run_dir = Path(run_dir)
        raise


# What two paired runs may differ in: the arm (its norm node) and what a resume may change (where the run is,
# how it reports, the same math batched, compiled or sharded otherwise: run_config.ALLOWED_CHANGES).
PAIRING_MAY_DIFFER = (*ALLOWED_CHANGES, "norm")


def design_difference(run_dir: str | None, other_dir: str | None) -> tuple[str, object, object] | None:
    """The first setting other than the arm in which two runs' recorded configs differ, as (key, this run's
    value, the other's), None when the arm is all (or a run has no recorded config: a copy without it pairs by
    its identity)."""
    if not run_dir or not other_dir:
        return None
    config, other = read_run_config(Path(run_dir)), read_run_config(Path(other_dir))
    if not config or not other:
        return None
    changes = config_changes(config, other, allowed=PAIRING_MAY_DIFFER)
    if not changes:
        return None
    key, (value, other_value) = next(iter(changes.items()))
    return key, value, other_value


def recorded_norm(run_dir: Path) -> str | None:
    """The norm of the run's first angles record: what a copied run without its config still says."""
    try:
        with open(RunFolder(run_dir).angles, encoding="utf-8", errors="replace") as handle:
            row = json.loads(handle.readline())
    except (OSError, json.JSONDecodeError):
        return None
    return row.get("norm") if isinstance(row, dict) else None


def identity_from_config(config: Mapping, norm: str | None = None) -> RunIdentity:
    """A run's identity from its config; ``norm`` stands in where the config has none (a copied run)."""
    seed = config.get("seed")
    return RunIdentity(norm=(config.get("norm") or {}).get("name") or norm,
                       placement=recorded_value(config, "placement.name"),
                       size=(config.get("size") or {}).get("name"),
                       seed=int(seed) if seed is not None else None)


def run_identity(run_dir: Path) -> RunIdentity:
    """The identity of the run in ``run_dir``; raises :class:`DamagedRecords` when its config is damaged."""
    config = read_run_config(run_dir)
    return identity_from_config(config,
                                None if (config.get("norm") or {}).get("name") else recorded_norm(run_dir))


class DuplicateRuns(Refusal, ValueError):
    """Two or more folders hold the same run (arm keys and seed). The message names each folder on a line of
    its own and ends with the fix on the last line."""

    def __init__(self, groups: list[tuple[RunIdentity, list[str]]]) -> None:
        self.groups = groups
        lines = []
        for identity, folders in groups:
            lines.append(f"{len(folders)} folders hold the same run ({identity}):")
            lines += [f"  {folder}" for folder in folders]
        count = sum(len(folders) for _, folders in groups)
        lines.append(
            f"error: {count} run folders are duplicates of one run (listed above): move all but one of "
            "each out of the sweep folder (a backup copy, or two sweeps under one folder), or name the run "
            "directories to read one by one; nothing was read or written"
        )
        super().__init__("\n".join(lines))


def check_unique(identities: Iterable[tuple[str | Path, RunIdentity]]) -> None:
    """Raise :class:`DuplicateRuns` when two folders share an identity (the one rule of every reader)."""
    by_identity: dict[RunIdentity, list[str]] = {}
    for folder, identity in identities:
        # nothing says which run it is (no config, no norm in its records): no duplicate
        if identity.norm is None:
            continue
        by_identity.setdefault(identity, []).append(str(folder))
    groups = [(identity, sorted(folders)) for identity, folders in by_identity.items() if len(folders) > 1]
    if groups:
        raise DuplicateRuns(groups)


def check_unique_runs(run_dirs: Iterable[Path]) -> None:
    """:func:`check_unique` over run directories; a run whose config is damaged is left to its reader."""
    identities = []
    for run_dir in dict.fromkeys(Path(d).resolve() for d in run_dirs):  # one folder named twice is one run
        try:
            identities.append((run_dir, run_identity(run_dir)))
        except DamagedRecords:
            continue
    check_unique(identities)
