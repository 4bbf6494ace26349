"""The metrics a run logged, read back as one tidy table.

Every run logs its scalars to ``<run_dir>/csv/version_N/metrics.csv`` (one version per session), whichever
other loggers it uses (train.py's ``make_loggers`` adds Lightning's ``CSVLogger`` when the config has none):
status, compare, the pilot and the export read that file, never wandb's or TensorBoard's binary logs.
``read_metrics(run_dir)`` returns a pandas DataFrame with columns ``step, metric, value`` (one row per
logged value; when a step was logged twice, e.g. by a resumed session, the later session wins).
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from normgeo.measure.records import DamagedRecords
from normgeo.run_folder import METRICS_FILE, RunFolder
from normgeo.runs.summary import read_summary

COLUMNS = ["step", "metric", "value"]


def session_number(version_dir: Path) -> int:
    """N of ``version_N`` (Lightning's CSVLogger starts a new version per session)."""
    suffix = version_dir.name.removeprefix("version_")
    return int(suffix) if suffix.isdigit() else 0


def metrics_damage(path: Path, line: int, reason: str) -> DamagedRecords:
    """A damaged ``metrics.csv``, named with the CSV's own fix (a row can be removed; a later session's
    rows are in its own version folder)."""
    return DamagedRecords(path, line, reason, "copy the file again from where the run wrote it, or remove "
                          "that row to keep the others", what="metrics row")


def read_metrics_file(path: Path, last_step: int | None = None) -> pd.DataFrame:
    """One session's ``metrics.csv`` as logged (a column per metric, a row per step), every cell a number or
    empty, each metric's steps increasing and none past ``last_step`` (the run's max_steps); raises
    :class:`DamagedRecords` naming the file, the row's line and what it expected."""
    try:
        wide = pd.read_csv(path)
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as err:
        row = re.search(r"(?:row|line) (\d+)", str(err))
        # pandas counts data rows from 0 (the file's line 2) in "row N", the file's lines in "line N"
        line = (int(row.group(1)) + (2 if "row" in row.group(0) else 0)) if row else 1
        raise metrics_damage(path, line, str(err).strip().splitlines()[-1]) from None
    if "step" not in wide.columns:
        raise metrics_damage(path, 1, f"no 'step' column in its header ({', '.join(map(str, wide.columns))})")
    for column in wide.columns:
        numbers = pd.to_numeric(wide[column], errors="coerce")
        bad = wide[column].notna() & numbers.isna()
        if bad.any():
            first = int(bad.to_numpy().nonzero()[0][0])
            raise metrics_damage(path, first + 2, f"{column!r} is {wide[column].iloc[first]!r}, expected a "
                                 "number")
        wide[column] = numbers
    for column in wide.columns.drop(["step", "epoch"], errors="ignore"):
        steps = wide["step"][wide[column].notna()]
        past = (steps < 0) | (steps > last_step if last_step is not None else False)
        bad = steps[past | (steps.diff() <= 0)]  # a session logs a step once, in order
        if not bad.empty:
            step, before = bad.iloc[0], steps.shift()[bad.index[0]]
            raise metrics_damage(path, int(bad.index[0]) + 2, f"{column!r} at step {step:g} " + (
                f"after step {before:g}" if before >= step else f"outside the run's steps 0 to {last_step}"))
    return wide


def read_metrics(run_dir: str | Path) -> pd.DataFrame:
    """Logged metrics (step, metric, value) of every session, the later session's value winning for a step;
    raises :class:`DamagedRecords` naming a damaged file (:func:`read_metrics_file`), also none at all from a
    run whose summary.json says it trained (every session's end flushes them)."""
    try:
        summary = read_summary(Path(run_dir))
    except DamagedRecords:  # named by the summary's reader; the rows are still checked for their shape
        summary = {}
    frames, empty = [], RunFolder(run_dir).csv  # the file (or folder) named when no session logged a row
    for version in sorted(empty.glob("version_*"), key=session_number):
        path = version / METRICS_FILE
        tidy = pd.DataFrame()
        if path.is_file() and path.stat().st_size:  # a killed session never flushed its metrics
            wide = read_metrics_file(path, summary.get("max_steps"))
            wide = wide.drop(columns="epoch", errors="ignore").dropna(subset=["step"])
            tidy = wide.melt(id_vars="step", var_name="metric", value_name="value").dropna(subset=["value"])
        if tidy.empty:
            empty = path if path.is_file() else empty
            continue
        frames.append(tidy.assign(session=session_number(version)))
    if not frames and summary.get("step", 0) > 0:
        raise DamagedRecords(empty, 1, f"{'no row' if empty.exists() else 'absent'}, while summary.json says "
                             f"the run trained to step {summary['step']}", "copy it again from where the run "
                             "wrote it", what="metrics")
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    frame = pd.concat(frames, ignore_index=True).astype({"step": int, "value": float})
    # A resumed session re-logs the steps after its checkpoint: the later session's value wins.
    frame = frame.sort_values("session", kind="stable").drop_duplicates(["step", "metric"], keep="last")
    return frame[COLUMNS].sort_values(["metric", "step"], kind="stable").reset_index(drop=True)


def last_value(frame: pd.DataFrame, metric: str) -> float | None:
    """The value at the highest step of ``metric``, None if it was never logged."""
    values = frame[frame["metric"] == metric]
    return None if values.empty else float(values.sort_values("step")["value"].iloc[-1])
