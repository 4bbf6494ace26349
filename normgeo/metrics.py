"""The metrics a run logged, read back from whichever logger it used, as one tidy table.

``read_metrics(run_dir)`` returns a pandas DataFrame with columns ``step, metric, value`` (one row per
logged value; when a step was logged twice, e.g. by a resumed session, the later session wins). The
readers know the layouts train.py's loggers write into the run directory (conf/logger/*.yaml):

- CSV: ``csv/version_N/metrics.csv`` (one version per session);
- TensorBoard: ``tensorboard/version_N/events.out.tfevents.*``;
- wandb: ``wandb/{offline-,}run-*/run-*.wandb`` (the transaction log wandb writes online and offline).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd

COLUMNS = ["step", "metric", "value"]


def _version(path: Path) -> int:
    name = path.name
    return int(name.split("_")[1]) if name.startswith("version_") and name.split("_")[1].isdigit() else 0


def _csv_rows(run_dir: Path) -> Iterator[tuple[int, int, str, float]]:
    """(session, step, metric, value) from every csv/version_N/metrics.csv."""
    for version in sorted((run_dir / "csv").glob("version_*"), key=_version):
        path = version / "metrics.csv"
        if not path.is_file():  # a killed session never flushed its metrics
            continue
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                step = row.pop("step", "")
                if not step:
                    continue
                for metric, value in row.items():
                    if metric != "epoch" and value not in ("", None):
                        yield _version(version), int(step), metric, float(value)


def _tensorboard_rows(run_dir: Path) -> Iterator[tuple[int, int, str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for version in sorted((run_dir / "tensorboard").glob("version_*"), key=_version):
        accumulator = EventAccumulator(str(version), size_guidance={"scalars": 0})  # 0: keep every value
        accumulator.Reload()
        for tag in accumulator.Tags().get("scalars", []):
            if tag == "epoch":
                continue
            for event in accumulator.Scalars(tag):
                yield _version(version), int(event.step), tag, float(event.value)


def wandb_history(path: Path) -> Iterator[dict]:
    """The history rows (``{"_step": k, "train/loss": ...}``) of one ``.wandb`` transaction log."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(path))
    while True:
        data = store.scan_data()
        if data is None:
            break
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        yield row


def wandb_runs(run_dir: Path) -> list[Path]:
    """The run's .wandb files, oldest session first."""
    return sorted((run_dir / "wandb").glob("*run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)


def _wandb_rows(run_dir: Path) -> Iterator[tuple[int, int, str, float]]:
    for session, path in enumerate(wandb_runs(run_dir)):
        for row in wandb_history(path):
            # Lightning's WandbLogger logs the trainer step as "trainer/global_step" (wandb's _step counts calls).
            step = row.get("trainer/global_step", row.get("_step"))
            if step is None:
                continue
            for metric, value in row.items():
                if metric.startswith("_") or metric in ("trainer/global_step", "epoch"):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    yield session, int(step), metric, float(value)


READERS: dict[str, Callable[[Path], Iterator[tuple[int, int, str, float]]]] = {
    "csv": _csv_rows,
    "tensorboard": _tensorboard_rows,
    "wandb": _wandb_rows,
}


def loggers_used(run_dir: Path) -> list[str]:
    """The loggers that left files in the run directory, in READERS order."""
    return [name for name in READERS if (Path(run_dir) / name).is_dir()]


def read_metrics(run_dir: str | Path, logger: str | None = None) -> pd.DataFrame:
    """Logged metrics (step, metric, value) from ``logger`` or the first logger the run used."""
    run_dir = Path(run_dir)
    names = [logger] if logger else loggers_used(run_dir)
    for name in names:
        rows = list(READERS[name](run_dir))
        if rows:
            frame = pd.DataFrame(rows, columns=["session", *COLUMNS])
            # A resumed session re-logs the steps after its checkpoint: the later session's value wins.
            frame = frame.sort_values("session", kind="stable").drop_duplicates(["step", "metric"], keep="last")
            return frame[COLUMNS].sort_values(["metric", "step"], kind="stable").reset_index(drop=True)
    return pd.DataFrame(columns=COLUMNS)


def last_value(frame: pd.DataFrame, metric: str) -> float | None:
    """The value at the highest step of ``metric``, None if it was never logged."""
    values = frame[frame["metric"] == metric]
    return None if values.empty else float(values.sort_values("step")["value"].iloc[-1])
