"""The output contract: ``angles.jsonl``, one JSON object per (step, layer, site, reference).

Every writer (training probe, ``analyze.py``) goes through :func:`write_step`, which rewrites the file
atomically with the step's old rows replaced: a killed run leaves only whole records and a resumed
run never duplicates a step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from normgeo.atomic import atomic_open
from normgeo.probe import REFERENCE_NAMES, ProbeSite
from normgeo.stats import QUANTILE_FIELDS, AngleStatistics

ANGLES_FILE = "angles.jsonl"
REFERENCES_FILE = "probe_references.npz"
FIELDS = (
    "model", "norm", "step", "tokens_seen", "layer", "site", "ref", "count", "zero_count",
    "mean_deg", "std_deg", "min_deg", "max_deg", *QUANTILE_FIELDS,
    "norm_mean", "norm_std", "rms_mean", "rms_std", "dim",
)


def _number(value: float) -> float | None:
    """JSON-safe float with 10 significant digits (NaN/inf, e.g. no samples, become null)."""
    value = float(value)
    return float(f"{value:.10g}") if math.isfinite(value) else None


def statistics_rows(
    sites: Sequence[ProbeSite],
    stats: AngleStatistics,
    *,
    model: str,
    norm: str,
    step: int | None,
    tokens_seen: int | None,
) -> list[dict]:
    """Rows of the contract for one probe; ``norm`` is the model's norm kind ("layer"/"rms")."""
    mean, std = stats.mean.cpu(), stats.std().cpu()
    low, high = stats.min.cpu(), stats.max.cpu()
    count, quantiles = stats.count.cpu(), stats.quantiles().cpu()
    zero = stats.zero_count.cpu()
    norm_mean, norm_std = stats.norm_mean.cpu(), stats.norm_std().cpu()
    rows = []
    for s, site in enumerate(sites):
        root_d = math.sqrt(site.dim)
        for r, ref in enumerate(REFERENCE_NAMES):
            row = {
                "model": model,
                "norm": norm,
                "step": step,
                "tokens_seen": tokens_seen,
                "layer": site.layer,
                "site": site.site,
                "ref": ref,
                "count": int(count[s, r]),
                "zero_count": int(zero[s]),
                "mean_deg": _number(mean[s, r]),
                "std_deg": _number(std[s, r]),
                "min_deg": _number(low[s, r]),
                "max_deg": _number(high[s, r]),
            }
            row.update({name: _number(quantiles[s, r, q]) for q, name in enumerate(QUANTILE_FIELDS)})
            row.update(
                norm_mean=_number(norm_mean[s]),
                norm_std=_number(norm_std[s]),
                rms_mean=_number(norm_mean[s] / root_d),
                rms_std=_number(norm_std[s] / root_d),
                dim=site.dim,
            )
            rows.append(row)
    return rows


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_step(path: str | Path, rows: list[dict]) -> None:
    """Replace the rows of the (model, norm, step) in ``rows`` and rewrite the file atomically."""

    def key(row: dict) -> tuple:
        return row["model"], row["norm"], row["step"]

    replaced = {key(row) for row in rows}
    kept = [row for row in read_rows(path) if key(row) not in replaced]
    with atomic_open(path, "w", encoding="utf-8") as handle:
        for row in [*kept, *rows]:
            handle.write(json.dumps(row) + "\n")


def recorded_steps(path: str | Path) -> set[int | None]:
    return {row["step"] for row in read_rows(path)}


def save_references(path: str | Path, references: dict[str, np.ndarray]) -> None:
    with atomic_open(path, "wb") as handle:
        np.savez(handle, **references)


def load_references(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}
