"""The output contract: ``angles.jsonl``, one JSON object per (step, layer, site, reference), and
``null.jsonl``, one per (step, layer, site): where the uniform vector 1 stands among K random directions.

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

from corpus.atomic import atomic_open
from corpus.refusal import Refusal
from normgeo.measure.probe import REFERENCE_NAMES, ProbeSite
from normgeo.measure.stats import (
    QUANTILE_FIELDS,
    AngleStatistics,
    block_bootstrap,
    json_number,
    null_comparison,
)

FIELDS = (
    "model", "norm", "step", "tokens_seen", "layer", "site", "ref", "count", "zero_count",
    "mean_deg", "std_deg", "min_deg", "max_deg", *QUANTILE_FIELDS,
    "norm_mean", "norm_std", "rms_mean", "rms_std", "dim",
)


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
                "model": model, "norm": norm, "step": step, "tokens_seen": tokens_seen, "layer": site.layer,
                "site": site.site, "ref": ref, "count": int(count[s, r]), "zero_count": int(zero[s]),
                "mean_deg": json_number(mean[s, r]), "std_deg": json_number(std[s, r]),
                "min_deg": json_number(low[s, r]), "max_deg": json_number(high[s, r]),
            }
            row.update({name: json_number(quantiles[s, r, q]) for q, name in enumerate(QUANTILE_FIELDS)})
            row.update(
                norm_mean=json_number(norm_mean[s]),
                norm_std=json_number(norm_std[s]),
                rms_mean=json_number(norm_mean[s] / root_d),
                rms_std=json_number(norm_std[s] / root_d),
                dim=site.dim,
            )
            rows.append(row)
    return rows


def null_rows(
    sites: Sequence[ProbeSite],
    stats: AngleStatistics,
    *,
    model: str,
    norm: str,
    step: int | None,
    tokens_seen: int | None,
    replicates: int = 1000,
    block: int = 1,
    seed: int = 0,
    level: float = 0.95,
) -> list[dict]:
    """Rows of ``null.jsonl``: 1 (reference 0) against the K null directions, one row per site.

    Empty when the probe ran without null directions (K < 2). The confidence intervals (block bootstrap
    over probe sequences) are null when no per-sequence statistics were kept.
    """
    if stats.num_null < 2:
        return []
    where = null_comparison(stats, ref=REFERENCE_NAMES.index("ones"))
    boot: dict[str, np.ndarray] = {}
    if stats.num_sequences:
        R = stats.num_refs
        boot = block_bootstrap(stats.seq_count.cpu().numpy(), stats.seq_sum.cpu().numpy(), ref=0,
                               null=slice(R, R + stats.num_null), replicates=replicates, block=block,
                               seed=seed, level=level)
    count = stats.count.cpu()
    measured = (stats.seq_count.cpu() > 0).sum(dim=1) if stats.num_sequences else None
    rows = []
    for s, site in enumerate(sites):
        mean = float(where["mean"][s])
        low, mid, high = (float(v) for v in where["mean_null_q"][s])
        std_q = [float(v) for v in where["std_null_q"][s]]
        row = {
            "model": model, "norm": norm, "step": step, "tokens_seen": tokens_seen, "layer": site.layer,
            "site": site.site, "dim": site.dim, "count": int(count[s, 0]),
            "sequences": int(measured[s]) if measured is not None else None, "null_k": stats.num_null,
            "mean_deg": json_number(mean),
            "mean_ci_low": json_number(boot["mean_low"][s]) if boot else None,
            "mean_ci_high": json_number(boot["mean_high"][s]) if boot else None,
            "null_mean_p05": json_number(low), "null_mean_p50": json_number(mid),
            "null_mean_p95": json_number(high),
            "mean_rank_pct": json_number(where["mean_rank"][s]),
            "mean_z": json_number(where["mean_z"][s]),
            "in_null_band": bool(low <= mean <= high),
            "diff_deg": json_number(mean - mid),
            "diff_ci_low": json_number(boot["diff_low"][s]) if boot else None,
            "diff_ci_high": json_number(boot["diff_high"][s]) if boot else None,
            "std_deg": json_number(where["std"][s]),
            "null_std_p05": json_number(std_q[0]), "null_std_p50": json_number(std_q[1]),
            "null_std_p95": json_number(std_q[2]),
            "std_rank_pct": json_number(where["std_rank"][s]),
            "std_z": json_number(where["std_z"][s]),
            "ci_level": level if boot else None,
            "bootstrap_replicates": replicates if boot else None,
            "bootstrap_block": block if boot else None,
            "bootstrap_seed": seed if boot else None,
            "null_means": [json_number(v) for v in where["null_means"][s]],
            "null_stds": [json_number(v) for v in where["null_stds"][s]],
        }
        rows.append(row)
    return rows


class DamagedRecords(Refusal, ValueError):
    """A file of a run (a records file such as ``angles.jsonl``, ``summary.json``, ``metrics.csv``, the
    config) with a line that is not what it should hold, or nothing at all: a copy cut short, a disk that
    filled up, a hand edit. Names the file, the line (or key) and what it expected, ``what`` the file holds
    and ``fix`` the advice that fits the file; readers of many runs skip that run."""

    def __init__(
        self,
        path: Path,
        line: int,
        reason: str,
        fix: str = "copy the file again from where the run wrote it, or remove that line to keep the other "
        "records",
        what: str = "record",
    ) -> None:
        self.path, self.line = path, line
        self.run_dir: Path | None = None  # the run it belongs to, where a reader of a run's files knows it
        super().__init__(f"{path}:{line}: damaged {what} ({reason}); {fix}")


# What every record holds, in every records file: the key it is replaced by (write_step), and the fields that
# hold text (or null). ``layer`` is a block's index or a site's name ("final"); every other field holds a
# number, true/false, null, or a list (the null directions' means, a scope's sites, energy bins).
KEY_FIELDS = ("model", "norm", "step")
TEXT_FIELDS = frozenset(
    {"model", "norm", "site", "ref", "quantity", "kind", "scope", "scope_name", "site_class", "action",
     "output", "bucket"}
)


def record_problem(row: dict) -> str | None:
    """What is wrong with one parsed record, in words, or None: a field of the key missing, text where a
    number belongs, a number where text belongs."""
    missing = [key for key in KEY_FIELDS if key not in row]
    if missing:
        return f"no {', '.join(map(repr, missing))}: every record has {', '.join(map(repr, KEY_FIELDS))}"
    step = row["step"]
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        return f"'step' is {step!r}, expected a whole number or null"
    if step is not None and step < 0:
        return f"'step' is {step}, expected 0 or more"
    for key, value in row.items():
        if key in TEXT_FIELDS:
            if value is not None and not isinstance(value, str):
                return f"{key!r} is {value!r}, expected text"
        elif key == "layer":
            if value is not None and not isinstance(value, (int, str)):
                return f"'layer' is {value!r}, expected a layer index or a site's name"
        elif isinstance(value, (str, dict)):
            return f"{key!r} is {value!r}, expected a number"
        elif not all(math.isfinite(v) for v in (value if isinstance(value, list) else [value])
                     if isinstance(v, float)):
            return f"{key!r} is {value!r}, expected finite numbers (the probe writes null where none is)"
    return None


def record_key(row: dict) -> tuple:
    """What tells one record from another in every records file: its fields that are not measured values
    (the key, the layer, the site, the reference, the scope...)."""
    return tuple((key, row[key]) for key in sorted(row) if key in KEY_FIELDS or key in TEXT_FIELDS
                 or key == "layer")


def read_rows(path: str | Path, last_step: int | None = None) -> list[dict]:
    """Every record of a ``.jsonl`` file ([] when it is absent or empty: a measurement with nothing to
    measure, such as DyT's ellipsoid, writes an empty file); raises :class:`DamagedRecords` at the first line
    that is not a JSON object, whose fields are not what a record holds (:func:`record_problem`), that
    repeats an earlier record (:func:`record_key`) or whose step is past ``last_step`` (the run's
    max_steps)."""
    path = Path(path)
    if not path.exists():
        return []
    rows, lines = [], {}
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DamagedRecords(
                    path, number, f"{err.msg.removesuffix(' at')} at column {err.colno}"
                ) from None
            if not isinstance(row, dict):
                raise DamagedRecords(path, number, f"a JSON {type(row).__name__}, not an object")
            problem = record_problem(row)
            if problem is None and last_step is not None and (row["step"] or 0) > last_step:
                problem = f"step {row['step']} is past the run's last step, max_steps={last_step}"
            if problem is None and (first := lines.setdefault(record_key(row), number)) != number:
                problem = f"the record of line {first} again (step {row['step']}, the same fields)"
            if problem is not None:
                raise DamagedRecords(path, number, problem)
            rows.append(row)
    return rows


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
