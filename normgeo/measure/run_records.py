"""Every records file of a run, read by one rule for every reader (``compare``, ``status``, ``report``, the
verdict, a resumed run's start): a damaged line (a copy cut short, a full disk, a hand edit) raises
:class:`DamagedRecords` naming the file and line, and the reader leaves that run out (``status`` lists it as
damaged), naming it on stderr. The files are also checked for what the run's config says they hold
(:class:`Expected`): no step past ``max_steps``, the steps of ``angles.jsonl`` in every file each probe
writes, and no file a probe writes absent or empty where it always holds records. Here, beside the
measurements that write the files, so that the run's start (normgeo.runs, a floor below the readers) reads
them by the same rule."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from normgeo.measure.records import DamagedRecords, read_rows
from normgeo.run_folder import (
    ANGLES_FILE,
    ELLIPSOID_FILE,
    ENERGY_FILE,
    MEAN_SOURCES_FILE,
    NULL_FILE,
    RECORD_FILES,
    RunFolder,
)

# Every probe of every arm measures these (the norms' inputs): empty beside a filled angles.jsonl is damage,
# unlike a measurement that may find nothing to measure (DyT's ellipsoid, an arm without centering).
FILLED_BY_EVERY_PROBE = (ENERGY_FILE,)
COPY_AGAIN = "copy it again from where the run wrote it"


def whole(value: object) -> int | None:
    """``value`` where it is a whole number (true/false is not), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Expected:
    """What a run's config says its records hold: no step past ``last_step`` (max_steps); every probe writes
    the files of ``written`` (absent beside angles.jsonl's records: damage) with a record in those of
    ``filled`` (empty: damage)."""

    last_step: int | None = None
    written: frozenset[str] = frozenset()
    filled: frozenset[str] = frozenset(FILLED_BY_EVERY_PROBE)

    @classmethod
    def of(cls, config: Mapping) -> Expected:
        probe = config.get("probe") if isinstance(config.get("probe"), Mapping) else {}
        last_step = whole(config.get("max_steps"))
        if whole(probe.get("null_directions")) is None:  # no probe settings recorded: the steps only
            return cls(last_step)
        # rank 0 writes null.jsonl at every probe, with rows when there are null directions
        on = {NULL_FILE: probe["null_directions"] > 0, MEAN_SOURCES_FILE: probe.get("mean_sources") is True}
        return cls(last_step, frozenset({NULL_FILE, ENERGY_FILE, ELLIPSOID_FILE, *(n for n in on if on[n])}),
                   frozenset({*FILLED_BY_EVERY_PROBE, *(name for name, yes in on.items() if yes)}))


def read_run_records(run_dir: Path, config: Mapping | None = None) -> dict[str, list[dict]]:
    """Every records file of ``run_dir`` by name ([] for an absent one), checked against ``config`` (the
    run's, :class:`Expected`); raises DamagedRecords (file:line) for the first damaged one
    (:func:`read_record_file`)."""
    angles = read_record_file(run_dir, ANGLES_FILE, config=config)
    return {name: angles if name == ANGLES_FILE else read_record_file(run_dir, name, angles, config)
            for name in RECORD_FILES}


def read_record_file(run_dir: Path, name: str, angles: list[dict] | None = None,
                     config: Mapping | None = None) -> list[dict]:
    """One records file of ``run_dir`` ([] when absent); raises DamagedRecords (file:line), also for an
    ``angles.jsonl`` without a record (every probe writes angles; a measurement with nothing to measure, such
    as DyT's ellipsoid, leaves its own file empty), for a step past the run's max_steps, and, beside the
    run's ``angles`` records, for a file that does not hold their steps or that the run's probe always writes
    (or fills) absent (or empty)."""
    expected = Expected.of(config or {})
    path = RunFolder(run_dir).record(name)
    rows = read_rows(path, expected.last_step)
    if name == ANGLES_FILE and path.is_file() and not rows:
        raise DamagedRecords(path, 1, "no record in the file", COPY_AGAIN)
    steps = {row["step"] for row in angles or []}
    if not steps:
        return rows
    trained = steps != {None}  # a training run's probes, not an analysis of one model
    absent = not path.is_file()
    if not rows and (name in expected.written and trained if absent else name in expected.filled):
        raise DamagedRecords(path, 1, f"{'absent' if absent else 'no record in the file'}, while "
                             f"{ANGLES_FILE} has {len(angles)} (every probe writes both)", COPY_AGAIN)
    held = {row["step"] for row in rows}
    # angles.jsonl is written last (an interrupted probe may leave the others a newer step, re-measured)
    if rows and steps - held:
        raise DamagedRecords(path, 1, f"records of steps {listed(held)}, while {ANGLES_FILE} has steps "
                             f"{listed(steps)} (every probe writes both)", "copy both again from where "
                             "the run wrote them")
    return rows


def listed(steps: set[int | None]) -> str:
    return ", ".join("pretrained" if step is None else str(step)
                     for step in sorted(steps, key=lambda step: -1 if step is None else step))
