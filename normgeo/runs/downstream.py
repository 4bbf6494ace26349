"""A run's downstream scores (``eval.json``, written by ``python -m normgeo.evaluate``), read back for the verdict.

``eval.json`` holds, per lm-evaluation-harness task, the scores of one exported checkpoint: ``{"step": N,
"checkpoint": ..., "tasks": {"<task>": {"acc": 0.31, "acc_stderr": 0.02, "acc_norm": ...}}, ...}``. The
verdict reads each score as the run's metric ``downstream/<task>/<metric>`` (higher is better).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

EVAL_FILE = "eval.json"
DOWNSTREAM_PREFIX = "downstream/"
SCORES = ("acc", "acc_norm")  # the scores compared; their standard errors stay in eval.json


def downstream_scores(run_dir: Path) -> dict[str, float]:
    """``{"downstream/<task>/<score>": value}`` from the run's eval.json; empty without one."""
    path = Path(run_dir) / EVAL_FILE
    if not path.is_file():
        return {}
    tasks = json.loads(path.read_text()).get("tasks", {})
    return {f"{DOWNSTREAM_PREFIX}{task}/{score}": float(values[score])
            for task, values in sorted(tasks.items()) for score in SCORES
            if isinstance(values.get(score), (int, float)) and math.isfinite(values[score])}


def is_downstream(metric: str) -> bool:
    return metric.startswith(DOWNSTREAM_PREFIX)
