"""The metrics a run logged, read back from whichever logger it used, as one tidy table.

``read_metrics(run_dir)`` returns a pandas DataFrame with columns ``step, metric, value`` (one row per
logged value; when a step was logged twice, e.g. by a resumed session, the later session wins). The
readers know the layouts train.py's loggers write into the run directory (conf/train/logger/*.yaml):

- CSV: ``csv/version_N/metrics.csv`` (one version per session);
- TensorBoard: ``tensorboard/version_N/events.out.tfevents.*``;
- wandb: ``wandb/{offline-,}run-*/run-*.wandb`` (the transaction log wandb writes online and offline).
"""

from __future__ import annotations

import csv
import json
import math
import struct
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
    # Optional: only for runs logged to TensorBoard.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for version in sorted((run_dir / "tensorboard").glob("version_*"), key=_version):
        accumulator = EventAccumulator(str(version), size_guidance={"scalars": 0})  # 0: keep every value
        accumulator.Reload()
        for tag in accumulator.Tags().get("scalars", []):
            if tag == "epoch":
                continue
            for event in accumulator.Scalars(tag):
                yield _version(version), int(event.step), tag, float(event.value)


# The .wandb file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
# chunks, each with a 7-byte header (crc32, length, type: full / first / middle / last) and a piece of one
# serialized wandb Record protobuf. wandb >= 0.19 (wandb-core) has no Python reader of its own.
_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[bytes]:
    """The serialized records of a ``.wandb`` file (a truncated last record, of a killed run, is dropped)."""
    data = Path(path).read_bytes()
    ident, _, _ = _FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B":
        raise ValueError(f"{path} is not a wandb transaction log")
    offset, pending = _FILE_HEADER.size, b""
    while offset + _CHUNK_HEADER.size <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _CHUNK_HEADER.size:  # the block's tail is padding
            offset += left_in_block
            continue
        _, length, kind = _CHUNK_HEADER.unpack_from(data, offset)
        start = offset + _CHUNK_HEADER.size
        if kind == 0 or start + length > len(data):
            break
        chunk, offset = data[start : start + length], start + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def wandb_history(path: Path) -> Iterator[dict]:
    """The history rows (``{"_step": k, "train/loss": ...}``) of one ``.wandb`` transaction log."""
    # wandb is heavy to import: only for runs logged to wandb alone.
    from wandb.proto import wandb_internal_pb2

    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            path = [item.key] if item.key else list(item.nested_key)
            value = json.loads(item.value_json)
            if len(path) == 1:
                row[path[0]] = value
            else:  # a media object (image, table) arrives as one item per field: nest them again
                row.setdefault(path[0], {})[path[1]] = value
        yield row


def wandb_media(run_dir: Path) -> dict[str, set[str]]:
    """Media keys of the run's wandb history and their types ({"figures/loss": {"images/separated"}})."""
    media: dict[str, set[str]] = {}
    for path in wandb_runs(Path(run_dir)):
        for row in wandb_history(path):
            for key, value in row.items():
                if isinstance(value, dict) and "_type" in value:
                    media.setdefault(key, set()).add(value["_type"])
    return media


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
