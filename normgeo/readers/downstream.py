"""A run's downstream scores (``eval.json``, written by
``python -m normgeo.evaluate``), read back for the verdict.

``eval.json`` holds, per lm-evaluation-harness task, its scores and what they were measured at: ``{"step": N,
"checkpoint": ..., "limit": ..., "context": 32, "tasks": {"<task>": {"acc": 0.31,
"acc_stderr": 0.02, "step": N, "limit": ..., "context": 32, "truncated": 8, ...}}}``
(``truncated``: the examples longer than the context). Evaluations accumulate: a new one
replaces only the tasks it measured. The verdict reads each score as the run's metric
``downstream/<task>/<metric>`` (higher is better), paired only with scores measured alike. """

from __future__ import annotations

import json
import math
from pathlib import Path

from normgeo.run_folder import RunFolder
from normgeo.runs.formats import EVAL_MEASURED_AT, eval_as_today

DOWNSTREAM_PREFIX = "downstream/"
MEASURED_AT_PREFIX = "measured_at/"  # the measures' column of what a task's scores were measured at
SCORES = ("acc", "acc_norm")  # the scores compared; their standard errors stay in eval.json


def read_eval(run_dir: Path) -> dict:
    """The run's eval.json ({} without one); a damaged one is a ValueError naming the file and the fix."""
    path = RunFolder(run_dir).eval
    if not path.is_file():
        return {}

    def damaged(what: str) -> ValueError:
        return ValueError(f"{path}: {what}; move it away and evaluate again")

    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise damaged(f"damaged ({err.msg} at line {err.lineno})") from err
    except UnicodeDecodeError as err:  # bytes, not text (a binary file in its place)
        raise damaged(f"damaged (not utf-8 text at byte {err.start})") from err
    if not isinstance(record, dict) or not isinstance(record.get("tasks", {}), dict):
        raise damaged("not an eval.json (no tasks mapping)")
    for task, values in record.get("tasks", {}).items():
        if not isinstance(values, dict):
            raise damaged(f"task {task!r} holds {values!r}, not a mapping of its scores")
    return eval_as_today(record)


def merged_eval(earlier: dict, measured: dict, scores: dict[str, dict]) -> dict:
    """eval.json after an evaluation: every earlier task's score kept, each task just measured replaced; each
    task carries what it was measured at (``measured``: step, checkpoint, limit, lm-eval version), the top
    level the latest evaluation's."""
    tasks = dict(earlier.get("tasks", {}))
    tasks.update({task: {**values, **measured} for task, values in scores.items()})
    return {**measured, "tasks": dict(sorted(tasks.items()))}


def downstream_scores(run_dir: Path) -> dict[str, float | str]:
    """``{"downstream/<task>/<score>": value}`` from the run's eval.json, and per task what its scores were
    measured at (``{"measured_at/<task>": "step 3, limit 8"}``: scores measured otherwise are not comparable);
    empty without one."""
    record = read_eval(run_dir)
    scores: dict[str, float | str] = {}
    for task, values in sorted(record.get("tasks", {}).items()):
        found = {f"{DOWNSTREAM_PREFIX}{task}/{score}": float(values[score]) for score in SCORES
                 if isinstance(values.get(score), (int, float)) and math.isfinite(values[score])}
        if found:
            step, limit, context = (values.get(key) for key in EVAL_MEASURED_AT)
            scores.update(found)
            scores[f"{MEASURED_AT_PREFIX}{task}"] = (
                f"step {step}, limit {limit if limit is not None else 'none'}"
                + (f", context {context}" if context is not None else "")
            )
    return scores


def measured_at_key(metric: str) -> str:
    """``downstream/<task>/<score>`` -> ``measured_at/<task>``."""
    return MEASURED_AT_PREFIX + metric.removeprefix(DOWNSTREAM_PREFIX).split("/")[0]


def is_downstream(metric: str) -> bool:
    return metric.startswith(DOWNSTREAM_PREFIX)
