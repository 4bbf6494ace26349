"""What a run sent to wandb, read back from its offline transaction log (``wandb/offline-run-*/run-*.wandb``).

The harness itself never reads these files (it reads the CSV every run writes, normgeo.readers.metrics_csv);
the tests do, to check what wandb received without a server. wandb >= 0.19 (wandb-core) has no Python reader.
The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks,
each with a 7-byte header (crc32, length, type: full / first / middle / last) and a piece of one serialized
wandb Record protobuf.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
from wandb.proto import wandb_internal_pb2

FILE_HEADER = struct.Struct("<4sHB")
CHUNK_HEADER = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_runs(run_dir: Path) -> list[Path]:
    """The run's .wandb files, oldest session first."""
    return sorted((run_dir / "wandb").glob("*run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)


def wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of a ``.wandb`` file (a truncated last record, of a killed run, is dropped)."""
    data = Path(path).read_bytes()
    ident, _, _ = FILE_HEADER.unpack_from(data, 0)
    assert ident == b":W&B", f"{path} is not a wandb transaction log"
    offset, pending = FILE_HEADER.size, b""
    while offset + CHUNK_HEADER.size <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < CHUNK_HEADER.size:  # the block's tail is padding
            offset += left_in_block
            continue
        _, length, kind = CHUNK_HEADER.unpack_from(data, offset)
        start = offset + CHUNK_HEADER.size
        if kind == 0 or start + length > len(data):
            break
        chunk, offset = data[start : start + length], start + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk if kind == FULL else pending + chunk)
            yield record
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk


def wandb_history(path: Path) -> Iterator[dict]:
    """The history rows (``{"_step": k, "train/loss": ...}``) of one ``.wandb`` transaction log."""
    for record in wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            keys = [item.key] if item.key else list(item.nested_key)
            value = json.loads(item.value_json)
            if len(keys) == 1:
                row[keys[0]] = value
            else:  # a media object (image, table) arrives as one item per field: nest them again
                row.setdefault(keys[0], {})[keys[1]] = value
        yield row


def wandb_scalars(run_dir: Path) -> pd.DataFrame:
    """(step, metric, value) of every finite scalar sent to wandb, at Lightning's trainer step."""
    rows = []
    for path in wandb_runs(run_dir):
        for row in wandb_history(path):
            step = row.get("trainer/global_step", row.get("_step"))  # wandb's own _step counts log calls
            rows += [
                (int(step), metric, float(value))
                for metric, value in row.items()
                if step is not None
                and not metric.startswith("_")
                and metric not in ("trainer/global_step", "epoch")
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ]
    return pd.DataFrame(rows, columns=["step", "metric", "value"]).drop_duplicates(
        ["step", "metric"], keep="last"
    )


def wandb_media(run_dir: Path) -> dict[str, set[str]]:
    """Media keys of the run's wandb history and their types ({"figures/loss": {"images/separated"}})."""
    media: dict[str, set[str]] = {}
    for path in wandb_runs(run_dir):
        for row in wandb_history(path):
            for key, value in row.items():
                if isinstance(value, dict) and "_type" in value:
                    media.setdefault(key, set()).add(value["_type"])
    return media
