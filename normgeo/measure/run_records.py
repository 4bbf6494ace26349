"""Every records file of a run, read by one rule for every reader (``compare``, ``status``, ``report``, the
verdict, a resumed run's start): a damaged line (a copy cut short, a full disk, a hand edit) raises
:class:`DamagedRecords` naming the file and line, and the reader leaves that run out (``status`` lists it as
damaged), naming it on stderr. Here, beside the measurements that write the files, so that the run's start
(normgeo.runs, a floor below the readers) reads them by the same rule."""

from __future__ import annotations

from pathlib import Path

from normgeo.measure.records import DamagedRecords, read_rows
from normgeo.run_folder import ANGLES_FILE, ENERGY_FILE, RECORD_FILES, RunFolder

# Every probe of every arm measures these (the norms' inputs): empty beside a filled angles.jsonl is damage,
# unlike a measurement that may find nothing to measure (DyT's ellipsoid, an arm without centering).
FILLED_BY_EVERY_PROBE = (ENERGY_FILE,)


def read_run_records(run_dir: Path) -> dict[str, list[dict]]:
    """Every records file of ``run_dir`` by name ([] for an absent one); raises DamagedRecords (file:line)
    for the first damaged one (:func:`read_record_file`)."""
    angles = read_record_file(run_dir, ANGLES_FILE)
    return {name: angles if name == ANGLES_FILE else read_record_file(run_dir, name, angles)
            for name in RECORD_FILES}


def read_record_file(run_dir: Path, name: str, angles: list[dict] | None = None) -> list[dict]:
    """One records file of ``run_dir`` ([] when absent); raises DamagedRecords (file:line), also for an
    ``angles.jsonl`` without a record (every probe writes angles; a measurement with nothing to measure, such
    as DyT's ellipsoid, leaves its own file empty) and for an empty file that every probe fills beside the
    run's ``angles`` records."""
    path = RunFolder(run_dir).record(name)
    rows = read_rows(path)
    if name == ANGLES_FILE and path.is_file() and not rows:
        raise DamagedRecords(path, 1, "no record in the file", "copy it again from where the run wrote it")
    if name in FILLED_BY_EVERY_PROBE and angles and path.is_file() and not rows:
        # written with angles.jsonl at every probe, never empty beside it
        raise DamagedRecords(path, 1, f"no record in the file, while {ANGLES_FILE} has {len(angles)}",
                             "copy it again from where the run wrote it")
    return rows
