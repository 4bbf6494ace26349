"""A sweep's training runs as tidy tables: every run's records, logged metrics and config, and the
per-run summary (:func:`summary_table`). What the comparison figures and the verdict are computed from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from normgeo.figures.style import POST_SUFFIX
from normgeo.measure.records import DamagedRecords, read_rows
from normgeo.readers.identity import check_unique_runs, identity_from_config, read_run_files
from normgeo.readers.metrics_csv import last_value
from normgeo.readers.run_states import find_runs, is_analysis
from normgeo.run_folder import ANGLES_FILE, RunFolder
from normgeo.runs.formats import metrics_as_today


@dataclass
class Comparison:
    """What the figures are drawn from: the tidy tables of all runs."""

    angles: pd.DataFrame  # angles.jsonl rows + run, arm, seed, size
    metrics: pd.DataFrame  # run, arm, seed, step, metric, value
    # one row per run: run, arm, placement, seed, size, norm, max_steps, tokens_per_step, run_dir
    runs: pd.DataFrame
    damaged: list[DamagedRecords] = field(default_factory=list)  # runs left out: a records file is damaged
    summaries: dict[str, dict] = field(default_factory=dict)  # run_dir -> its summary.json ({} when absent)


# --- loading ---------------------------------------------------------------------------------------------


def run_directories(paths: Sequence[Path]) -> list[Path]:
    """Training run directories at or below ``paths`` (analyze.py folders left out)."""
    found: list[Path] = []
    for path in paths:
        if RunFolder(path).angles.is_file() and not RunFolder(path).hydra.is_dir():
            found.append(path)  # a copied run without Hydra's files
            continue
        found += [run for run in find_runs(path) if not is_analysis(run) and RunFolder(run).angles.is_file()]
    return sorted(dict.fromkeys(p.resolve() for p in found))


def records_frame(comparison: Comparison, filename: str) -> pd.DataFrame:
    """One records file (``energy.jsonl``, ``intervention.jsonl``, ...) of every run, with the run's name,
    arm and seed; empty if no run has it."""
    frames = []
    for run in comparison.runs.itertuples():
        rows = read_rows(Path(run.run_dir) / filename)
        if rows:
            frames.append(pd.DataFrame(rows).assign(run=run.run, arm=run.arm, seed=run.seed))
    if not frames:
        return pd.DataFrame()
    frame = pd.concat(frames, ignore_index=True)
    frame = frame[frame["step"].notna()]
    frame["layer"] = frame["layer"].astype(str)
    return frame


def load(paths: Sequence[Path]) -> Comparison:
    """Every readable run under ``paths``; a run with a damaged records file is left out and listed in
    ``damaged``. Raises FileNotFoundError when no run is left."""
    runs, angle_frames, metric_frames, damaged, summaries = [], [], [], [], {}
    found = run_directories(paths)
    check_unique_runs(found)  # two folders of one arm and seed: refused before anything is read
    for run_dir in found:
        try:  # every file of the run read whole, by its one reader: a damaged one skips the run
            files = read_run_files(run_dir)
        except DamagedRecords as err:
            damaged.append(err)
            continue
        rows, config, summaries[str(run_dir)] = files.records[ANGLES_FILE], files.config, files.summary
        identity = identity_from_config(config, rows[0]["norm"])
        norm, placement = identity.norm, identity.placement
        info = {"run": config.get("run_name") or run_dir.name,
                "arm": norm + (POST_SUFFIX if placement == "post" else ""), "placement": placement,
                "seed": identity.seed, "size": identity.size}
        tokens_per_step = (config.get("global_batch") or 0) * (config.get("seq_len") or 0) or None
        runs.append({**info, "norm": norm, "max_steps": config.get("max_steps"),
                     "tokens_per_step": tokens_per_step, "run_dir": str(run_dir)})
        angles = pd.DataFrame(rows)
        angles = angles[angles["step"].notna()]  # a run's own records all have steps
        angles["layer"] = angles["layer"].astype(str)  # block indices and "final" in one column
        angle_frames.append(angles.assign(**info))
        metrics = files.metrics
        if not metrics.empty:
            metric_frames.append(metrics_as_today(metrics, config, tokens_per_step).assign(**info))
    if not runs:
        unread = f" ({len(damaged)} with damaged records: {'; '.join(map(str, damaged))})" if damaged else ""
        raise FileNotFoundError(f"no readable training runs with {ANGLES_FILE} under "
                                f"{', '.join(map(str, paths))}{unread}")
    runs_frame = pd.DataFrame(runs)
    if runs_frame["size"].nunique() > 1:  # arms of several sizes: the size is part of the arm
        for frame in (runs_frame, *angle_frames, *metric_frames):
            frame["arm"] = frame["size"].astype(str) + "-" + frame["arm"].astype(str)
    angles = pd.concat(angle_frames, ignore_index=True)
    angles["step"] = angles["step"].astype(int)
    order = ["run", "arm", "seed", "size"]
    angles = angles[order + [c for c in angles.columns if c not in order]]
    metrics = (
        pd.concat(metric_frames, ignore_index=True) if metric_frames
        else pd.DataFrame(columns=[*order, "step", "metric", "value"])
    )
    return Comparison(angles=angles, metrics=metrics[order + ["step", "metric", "value"]], runs=runs_frame,
                      damaged=damaged, summaries=summaries)


# --- summary ----------------------------------------------------------------------------------------------


def summary_table(comparison: Comparison) -> pd.DataFrame:
    """Per arm and seed: final step and losses, tokens, wall time, mean angle with 1 per site (final step)."""
    records = []
    for run in comparison.runs.itertuples():
        angles = comparison.angles[comparison.angles["run"] == run.run]
        final = int(angles["step"].max())
        metrics = comparison.metrics[comparison.metrics["run"] == run.run]
        end = comparison.summaries.get(run.run_dir, {})
        record = {
            "arm": run.arm, "seed": run.seed, "run": run.run, "final_step": final,
            "tokens": final * run.tokens_per_step if run.tokens_per_step else None,
            "train_loss": final_train_loss(end, metrics), "val_loss": last_value(metrics, "val/loss"),
            "wall_s": end.get("wall_s"), "tokens_per_s": end.get("tokens_per_s"),
        }
        at_final = angles[(angles["step"] == final) & (angles["ref"] == "ones")]
        for site, mean in at_final.groupby("site", sort=False)["mean_deg"].mean().items():
            record[f"ones_deg/{site}"] = float(mean)
        records.append(record)
    return pd.DataFrame(records).sort_values(["arm", "seed"], kind="stable").reset_index(drop=True)


def final_train_loss(summary: dict, metrics: pd.DataFrame) -> float | None:
    """The loss of the run's last optimizer step: summary.json's (the trainer's, whatever ``log_every``),
    else the last logged one (a run without a summary, e.g. killed)."""
    if summary.get("train_loss") is not None:
        return float(summary["train_loss"])
    return last_value(metrics, "train/loss")


def markdown(table: pd.DataFrame) -> str:
    def cell(value) -> str:
        if value is None or (isinstance(value, float) and pd.isna(value)):
            return "-"
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4g}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    for row in table.astype(object).itertuples(index=False):
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


