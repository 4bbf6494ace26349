"""The metrics a run logged, read back as one tidy table.

Every run logs its scalars to ``<run_dir>/csv/version_N/metrics.csv`` (one version per session), whichever
other loggers it uses (train.py's ``make_loggers`` adds Lightning's ``CSVLogger`` when the config has none):
status, compare, the pilot and the export read that file, never wandb's or TensorBoard's binary logs.
``read_metrics(run_dir)`` returns a pandas DataFrame with columns ``step, metric, value`` (one row per
logged value; when a step was logged twice, e.g. by a resumed session, the later session wins).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

COLUMNS = ["step", "metric", "value"]
CSV_DIR = "csv"  # Lightning's CSVLogger(save_dir=run_dir, name=CSV_DIR)


def session_number(version_dir: Path) -> int:
    """N of ``version_N`` (Lightning's CSVLogger starts a new version per session)."""
    suffix = version_dir.name.removeprefix("version_")
    return int(suffix) if suffix.isdigit() else 0


def read_metrics(run_dir: str | Path) -> pd.DataFrame:
    """Logged metrics (step, metric, value) of every session, the later session's value winning for a step."""
    frames = []
    for version in sorted((Path(run_dir) / CSV_DIR).glob("version_*"), key=session_number):
        path = version / "metrics.csv"
        if not path.is_file() or path.stat().st_size == 0:  # a killed session never flushed its metrics
            continue
        wide = pd.read_csv(path).drop(columns="epoch", errors="ignore").dropna(subset=["step"])
        tidy = wide.melt(id_vars="step", var_name="metric", value_name="value").dropna(subset=["value"])
        frames.append(tidy.assign(session=session_number(version)))
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
