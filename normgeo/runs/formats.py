"""Older runs through one door: what changed between the formats of a run's files, translated into today's
here only, for the resume (normgeo.runs.run_config) and every reader. The run config's ``format`` says the
format (run_config.yaml: the first session's; a checkpoint's copy: its session's); none is format 1, written
by code whose config may lack keys added since (the schema's ``before=``) or hold retired copies of others
(``model``, ``data.seq_len``), whose summary.json may lack ``session_log``, metrics.csv log the k-th update
at step k-1, eval.json hold what a task was measured at on its top level, logger config name the CSV every
run writes now, and folder lack ``.normgeo.lock`` (read as unheld: normgeo.runs.lock.check_unlocked)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import pandas as pd

from normgeo.config.schema import TrainSchema

FORMAT_KEY, FORMAT = "format", 2  # raised by a change that a translation here cannot undo for older runs
EVAL_MEASURED_AT = ("step", "limit", "context")  # what each task of eval.json was measured at


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``; lists and empty mappings stay whole values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def schema_fields(kind: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """Every field of the schema ``kind`` by its dotted key, a node's own fields after it."""
    for f in dataclasses.fields(kind):
        yield f"{prefix}{f.name}", f
        if dataclasses.is_dataclass(f.default_factory):
            yield from schema_fields(f.default_factory, f"{prefix}{f.name}.")  # type: ignore[arg-type]


def added_keys(kind: type) -> dict[str, Any]:
    """{dotted key: the value every run recorded before it existed} (the schema ``kind``'s ``before=``)."""
    return {key: value for name, f in schema_fields(kind) if (old := f.metadata.get("before", MISSING)) is not
            MISSING for key, value in flatten({name: old}).items()}


def declared(key: str, kind: type) -> bool:
    """Whether the dotted ``key`` is the schema ``kind``'s (anything under a node typed Any is)."""
    return any(key == name or key.startswith(f"{name}.") and not dataclasses.is_dataclass(f.default_factory)
               for name, f in schema_fields(kind))


def config_as_today(old: Mapping[str, Any], new: Mapping[str, Any], kind: type) -> tuple[dict, dict]:
    """A run's recorded flat config ``old`` and ``new`` (this session's, another run's) in today's keys: a key
    one side lacks given its ``before``, ``old``'s retired copies dropped, the format no setting."""
    before = added_keys(kind)
    old, new = ({key: value for key, value in flat.items() if key != FORMAT_KEY} for flat in (old, new))
    new = {**{key: before[key] for key in old if key not in new and key in before}, **new}
    kept = {key: value for key, value in old.items() if key in new or declared(key, kind)}
    return {**{key: before[key] for key in new if key not in old and key in before}, **kept}, new


def recorded_value(config: Mapping[str, Any], key: str) -> Any:
    """A recorded config's dotted ``key``, for a run from before it the value such runs had (else None)."""
    flat = flatten(config)
    return flat[key] if flat.get(key) is not None else added_keys(TrainSchema).get(key)


def logger_nodes(logger: Any, csv_dir: Path) -> list[Mapping[str, Any]]:
    """The nodes of ``cfg.logger`` (a dict name -> node; a null one skipped) but a CSVLogger into csv_dir."""
    nodes, csv = logger.values() if isinstance(logger, dict) else (logger or []), os.path.abspath(csv_dir)
    return [node for node in nodes if node and not (node["_target_"].endswith("CSVLogger") and csv ==
            os.path.abspath(Path(str(node.get("save_dir"))) / str(node.get("name") or "lightning_logs")))]


def summary_as_today(summary: dict[str, Any]) -> dict[str, Any]:
    """A read summary.json; one without ``session_log`` listed none of its sessions."""
    return {"session_log": [], **summary} if summary else summary


def metrics_as_today(metrics: pd.DataFrame, config: Mapping[str, Any], tokens_per_step: int | None
                     ) -> pd.DataFrame:
    """train/* and perf/* at the optimizer step whose update they describe (tokens_seen / tokens per step)."""
    tokens = metrics[metrics["metric"] == "train/tokens_seen"].set_index("step")["value"]
    if int(config.get(FORMAT_KEY) or 1) >= 2 or tokens.empty or not tokens_per_step:
        return metrics
    shift = {int(step): int(round(value / tokens_per_step)) for step, value in tokens.items()}
    train = metrics["metric"].str.startswith("train/") | metrics["metric"].str.startswith("perf/")
    metrics = metrics.copy()
    metrics.loc[train, "step"] = [shift.get(int(s), int(s)) for s in metrics.loc[train, "step"]]
    return metrics


def eval_as_today(record: dict[str, Any]) -> dict[str, Any]:
    """A read eval.json, each task with what it was measured at (older files: on the top level only)."""
    top = {key: record[key] for key in EVAL_MEASURED_AT if key in record}
    tasks = {task: {**top, **values} for task, values in record.get("tasks", {}).items()}
    return {**record, "tasks": tasks} if tasks else record
