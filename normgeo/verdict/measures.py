"""What is measured per run, for the verdict: one row per run of validation loss (final and tail), the angle
with 1 per site class, the pooled geometry of ``null.jsonl`` and ``energy.jsonl``, the centering
intervention and the downstream scores. The run is the unit: within a run records are pooled first.

Throughput is not a verdict measure: the runs of a study share a machine with other work, so their tokens/s
measures the load; the norms' cost is ``bench/norm_cost.py``'s (interleaved, load recorded)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd

from normgeo.measure.records import read_rows
from normgeo.readers.downstream import downstream_scores
from normgeo.readers.metrics_csv import last_value
from normgeo.run_folder import ENERGY_FILE, INTERVENTION_FILE, MEAN_SOURCES_FILE, NULL_FILE, RunFolder
from normgeo.verdict.metric_table import (
    GEOMETRY,
    INTERVENTION,
    INTERVENTION_METRICS,
    MEAN_FIRST,
    MEAN_TOP8,
    SITE_CLASSES,
)

VAL_TAIL = 0.2     # the primary statistic: the mean of the last 20% of the validation points
PROBE_WINDOW = 0.3  # the geometry's window: the last 30% of the probe steps
BAND = (5.0, 95.0)  # the null band's edges in rank percentile (null.jsonl's p05 and p95)


class RunTables(Protocol):
    """The tidy tables of a sweep (:class:`normgeo.figures.sweep.Comparison`): what the measures read."""

    runs: pd.DataFrame     # one row per run: run, run_dir, norm, size, placement, seed
    angles: pd.DataFrame   # angles.jsonl rows + run
    metrics: pd.DataFrame  # logged metrics: run, step, metric, value


def tail_mean(values: pd.Series, share: float) -> float | None:
    """The mean of the last ``share`` of a step-sorted series (at least its last point)."""
    if values.empty:
        return None
    count = max(1, math.ceil(share * len(values) - 1e-9))
    return float(values.iloc[-count:].mean())


def validation_curve(metrics: pd.DataFrame) -> pd.Series:
    """A run's validation loss by step (the last value logged at a step)."""
    val = metrics[metrics["metric"] == "val/loss"].dropna(subset=["value"]).sort_values("step")
    return val.groupby("step")["value"].last().sort_index()


def geometry_measures(run_dir: Path) -> dict[str, float | None]:
    """A run's pooled geometry: per probe step the mean over layers and site classes of 1's rank percentile,
    of its distance to the nearer band edge, and of the energy fraction along 1 at the norm inputs; at the
    last probe and over the last 30% of probe steps. Also the in-band share at the first and last step."""
    null_rows = read_rows(RunFolder(run_dir).record(NULL_FILE))
    null = pd.DataFrame([r for r in null_rows if r.get("step") is not None])
    out: dict[str, float | None] = {f"{kind}/{at}": None for kind in GEOMETRY for at in ("window", "last")}
    out.update({"first_step": None, "in_band_first": None, "in_band_last": None})
    per_step: dict[str, pd.Series] = {}
    if not null.empty and "mean_rank_pct" in null and null["mean_rank_pct"].notna().any():
        ranks = null.dropna(subset=["mean_rank_pct"])
        edge = np.minimum(ranks["mean_rank_pct"] - BAND[0], BAND[1] - ranks["mean_rank_pct"])
        per_step["rank_pct"] = ranks.groupby("step")["mean_rank_pct"].mean().sort_index()
        per_step["band_margin"] = edge.groupby(ranks["step"]).mean().sort_index()
    if not null.empty and "in_null_band" in null:
        band = null.dropna(subset=["in_null_band"])
        if not band.empty:
            share = band.groupby("step")["in_null_band"].mean().sort_index()
            out.update({"first_step": int(share.index[0]), "in_band_first": float(share.iloc[0]),
                        "in_band_last": float(share.iloc[-1])})
    energy = [r for r in read_rows(RunFolder(run_dir).record(ENERGY_FILE)) if r.get("step") is not None
              and r.get("quantity") == "ones_fraction" and r.get("mean") is not None]
    if energy:
        per_step["ones_energy"] = pd.DataFrame(energy).groupby("step")["mean"].mean().sort_index()
    for kind, series in per_step.items():
        out[f"{kind}/last"] = float(series.iloc[-1])
        out[f"{kind}/window"] = tail_mean(series, PROBE_WINDOW)
    return out


def intervention_measures(run_dir: Path) -> dict[str, float | str | None]:
    """A run's centering intervention, every norm at once: its loss change at the last probe and over the
    last 30% of probe steps, and what was done (remove: LayerNorm; add: RMSNorm)."""
    rows = [r for r in read_rows(RunFolder(run_dir).record(INTERVENTION_FILE))
            if r.get("scope") == "all" and r.get("step") is not None and r.get("delta_loss") is not None]
    rows.sort(key=lambda r: r["step"])
    out: dict[str, float | str | None] = {name: None for name in INTERVENTION_METRICS}
    out["intervention_action"] = rows[-1]["action"] if rows else None
    if rows:
        series = pd.Series([r["delta_loss"] for r in rows], index=[r["step"] for r in rows])
        out[f"{INTERVENTION}/last"] = float(series.iloc[-1])
        out[f"{INTERVENTION}/window"] = tail_mean(series, PROBE_WINDOW)
    return out


def mean_sources_measures(run_dir: Path) -> dict[str, float | None]:
    """Where a run's mean lives at its last probe: the share of E[μ²] at the probe windows' first position
    and the share of its 8 largest dimensions, each the mean over the norm inputs (None without the file)."""
    rows = [r for r in read_rows(RunFolder(run_dir).record(MEAN_SOURCES_FILE)) if r.get("step") is not None]
    out: dict[str, float | None] = {MEAN_FIRST: None, MEAN_TOP8: None}
    if not rows:
        return out
    last = max(r["step"] for r in rows)
    first = [r["mean_sq_share"] for r in rows if r["step"] == last and r["kind"] == "position"
             and r["bucket"] == "0" and r["mean_sq_share"] is not None]
    top8 = [r["top8_share"] for r in rows if r["step"] == last and r["kind"] == "dimensions"
            and r["top8_share"] is not None]
    out[MEAN_FIRST] = float(np.mean(first)) if first else None
    out[MEAN_TOP8] = float(np.mean(top8)) if top8 else None
    return out


def run_measures(tables: RunTables) -> pd.DataFrame:
    """One row per run: arm keys, validation loss (final and tail), the angle
    with 1 per site class at the last probe (and its mean over the site
    classes), the pooled geometry, the intervention, downstream scores."""
    rows = []
    for run in tables.runs.itertuples():
        angles = tables.angles[(tables.angles["run"] == run.run) & (tables.angles["ref"] == "ones")]
        last = int(angles["step"].max())
        at_last = angles[angles["step"] == last]
        metrics = tables.metrics[tables.metrics["run"] == run.run]
        row = {"run": run.run, "run_dir": run.run_dir, "norm": run.norm, "size": run.size,
               "placement": run.placement, "seed": run.seed, "last_step": last,
               "val_loss": last_value(metrics, "val/loss"),
               "val_loss/tail": tail_mean(validation_curve(metrics), VAL_TAIL)}
        for site in SITE_CLASSES:
            of_site = at_last[at_last["site"] == site]["mean_deg"].dropna()
            row[f"ones_dev/{site}"] = float((of_site - 90).abs().mean()) if len(of_site) else None
        per_site = [row[f"ones_dev/{site}"] for site in SITE_CLASSES if row[f"ones_dev/{site}"] is not None]
        row["ones_dev/all"] = float(np.mean(per_site)) if per_site else None  # the site classes pooled
        row.update(geometry_measures(Path(run.run_dir)))
        row.update(intervention_measures(Path(run.run_dir)))
        row.update(mean_sources_measures(Path(run.run_dir)))
        row.update(downstream_scores(Path(run.run_dir)))
        rows.append(row)
    return pd.DataFrame(rows)
