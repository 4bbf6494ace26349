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
    """Every records file of ``run_dir`` by name ([] for an absent one); raises DamagedRecords (file:line),
    also for an ``angles.jsonl`` without a record: every probe writes angles (a measurement with nothing to
    measure, such as DyT's ellipsoid, leaves its own file empty). Read whole before any figure or table is
    made, so that one damaged file leaves its run out instead of stopping a figure or the verdict half-way."""
    folder = RunFolder(run_dir)
    records = {name: read_rows(folder.record(name)) for name in RECORD_FILES}
    angles = folder.angles
    if angles.is_file() and not records[ANGLES_FILE]:
        raise DamagedRecords(angles, 1, "no record in the file", "copy it again from where the run wrote it")
    for name in FILLED_BY_EVERY_PROBE:  # written with angles.jsonl at every probe, never empty beside it
        if records[ANGLES_FILE] and folder.record(name).is_file() and not records[name]:
            raise DamagedRecords(folder.record(name), 1, f"no record in the file, while {ANGLES_FILE} has "
                                 f"{len(records[ANGLES_FILE])}", "copy it again from where the run wrote it")
    return records
