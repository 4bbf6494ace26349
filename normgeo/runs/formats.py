"""Older runs through one door: what changed between the formats of a run's files, translated into today's
here only, for the resume (normgeo.runs.run_config) and every reader (normgeo.readers, normgeo.figures).

A run records its format: ``format`` in its run config (run_config.yaml: the first session's; a checkpoint's
copy: the session's that wrote it); a config without one is format 1. What format 2 (today's) changed, each
translated by one function below:

- the config: keys added since hold the value every earlier run had (the schema's ``before=``: ``placement``
  was pre-norm); keys retired since (the LightningModule's ``model`` node, ``data.seq_len``) copied another
  key and are compared through it (:func:`config_as_today`, :func:`recorded_value`);
- a logger config may name a CSVLogger into ``csv/``, which every run writes now (:func:`logger_nodes`);
- summary.json had no ``session_log`` (:func:`summary_as_today`);
- metrics.csv held the k-th update's train/* at step k-1 (:func:`metrics_as_today`);
- eval.json held a task's step, limit and context at the top level only (:func:`eval_as_today`);
- no ``.normgeo.lock``: a folder without one is held by no process (normgeo.runs.lock.check_unlocked).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from normgeo.config.schema import TrainSchema

FORMAT_KEY = "format"
FORMAT = 2  # today's; a change that a translation here cannot undo for older runs raises it


def run_format(config: Mapping[str, Any]) -> int:
    """The format a run was recorded in (its run config's): 1 for a run from before formats were recorded."""
    return int(config.get(FORMAT_KEY) or 1)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``; lists and empty mappings stay whole values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def added_keys(kind: type) -> dict[str, Any]:
    """{dotted key: the value every run recorded before the key existed}, as the schema ``kind``'s fields
    declare it (schema.doc's ``before``)."""
    before: dict[str, Any] = {}
    for f in dataclasses.fields(kind):
        if (old := f.metadata.get("before", dataclasses.MISSING)) is not dataclasses.MISSING:
            before.update(flatten({f.name: old}))
        if dataclasses.is_dataclass(f.default_factory):
            before.update({f"{f.name}.{key}": value for key, value in added_keys(f.default_factory).items()})
    return before


def declared(key: str, kind: type) -> bool:
    """Whether the dotted ``key`` is one of the schema ``kind``'s (anything under a node conf/ writes, typed
    Any, is). A recorded key that is not is a retired copy of another key (normgeo/runs/build.py passes those
    values now)."""
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(kind)}
        if part not in fields:
            return False
        kind = fields[part].default_factory  # type: ignore[assignment]
        if not dataclasses.is_dataclass(kind):
            return True
    return True


def config_as_today(old: Mapping[str, Any], new: Mapping[str, Any], kind: type) -> tuple[dict, dict]:
    """Two flat configs, a run's recorded ``old`` and ``new``, in today's keys to compare: in ``old`` a key
    retired since (not declared by ``kind``) that ``new`` lacks is dropped, a key of ``new`` added since holds
    its ``before`` value; the format is no setting of the experiment."""
    before, new = added_keys(kind), {key: value for key, value in new.items() if key != FORMAT_KEY}
    kept = {key: value for key, value in old.items()
            if key != FORMAT_KEY and (key in new or declared(key, kind))}
    return {**{key: before[key] for key in new if key not in old and key in before}, **kept}, new


def recorded_value(config: Mapping[str, Any], key: str) -> Any:
    """The dotted ``key`` of a recorded config, for a run from before the key the value it had; None when
    neither says."""
    flat = flatten(config)
    return flat[key] if flat.get(key) is not None else added_keys(TrainSchema).get(key)


def logger_nodes(logger: Any, csv_dir: Path) -> list[Mapping[str, Any]]:
    """The nodes of ``cfg.logger`` (a dict name -> node; a null entry skipped) but a CSVLogger into
    ``csv_dir``, which older logger configs name: every run writes that CSV now."""
    nodes = logger.values() if isinstance(logger, dict) else (logger or [])
    return [node for node in nodes if node and not (
        node["_target_"].endswith("CSVLogger") and os.path.abspath(csv_dir) == os.path.abspath(
            Path(str(node.get("save_dir"))) / str(node.get("name") or "lightning_logs")))]


def summary_as_today(summary: dict[str, Any]) -> dict[str, Any]:
    """A read summary.json: one without ``session_log`` lists none of its sessions."""
    return {"session_log": [], **summary} if summary else summary


def metrics_as_today(metrics: pd.DataFrame, config: Mapping[str, Any],
                     tokens_per_step: int | None) -> pd.DataFrame:
    """train/* and perf/* metrics at the optimizer step they describe (tokens_seen / tokens per step): a
    format-1 run logged a step's loss before Lightning's step counter advanced, the k-th update's at step k-1,
    while the probe of the weights after it is recorded at step k."""
    tokens = metrics[metrics["metric"] == "train/tokens_seen"].set_index("step")["value"]
    if run_format(config) >= 2 or tokens.empty or not tokens_per_step:
        return metrics
    shift = {int(step): int(round(value / tokens_per_step)) for step, value in tokens.items()}
    train = metrics["metric"].str.startswith("train/") | metrics["metric"].str.startswith("perf/")
    metrics = metrics.copy()
    metrics.loc[train, "step"] = [shift.get(int(s), int(s)) for s in metrics.loc[train, "step"]]
    return metrics


EVAL_MEASURED_AT = ("step", "limit", "context")  # what each task of eval.json was measured at


def eval_as_today(record: dict[str, Any]) -> dict[str, Any]:
    """A read eval.json, every task holding what it was measured at: older files hold it at the top level."""
    top = {key: record[key] for key in EVAL_MEASURED_AT if key in record}
    tasks = {task: {**top, **values} for task, values in record.get("tasks", {}).items()}
    return {**record, "tasks": tasks} if tasks else record
