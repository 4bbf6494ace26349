"""Inference-time geometry of a trained model (paper section 3.2, Table 1, Figures 3, 6-13): the summary
that ``analyze.py`` writes, and across models ``python -m normgeo.analysis summary DIR [DIR ...]``. (Models
are loaded by :mod:`models.pretrained`, measured by :mod:`normgeo.measure.pipeline`.)

The summary pools, per model, site kind (``in``: before the norm, ``std``: after its standardization,
``out``: after the norm) and reference vector, the angles of every token at every norm, exactly: the
rows' (count, mean, std) are merged with Chan's formula, not averaged. That pooled number counts each
token once per norm, and signed deviations from 90 deg at different norms cancel in it; so the summary
also gives the per-norm view: the mean over norms of |mean angle - 90| and the spread (std) of the
per-norm means, and, from ``null.jsonl``, 1's percentile among the K random directions.
"""

from __future__ import annotations

import csv
import io
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from corpus.atomic import atomic_write_text
from normgeo.figures.tables import print_table
from normgeo.measure.probe import REFERENCE_NAMES
from normgeo.measure.stats import chan_merge

SITE_KINDS = ("in", "std", "out")
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
SUMMARY_FIELDS = (
    "model", "norm", "step", "site", "ref", "sites", "tokens", "vectors", "mean_deg", "std_deg", "min_deg",
    "max_deg", "norm_abs_dev_deg", "between_norm_std_deg", "norm_mean_min_deg", "norm_mean_max_deg",
    "null_k", "ones_pooled_rank_pct", "norms_in_null_band",
)


# Summary


def pool(rows: Iterable[dict]) -> dict:
    """count, mean, (population) std, min, max of the union of the rows' samples."""
    moments = (torch.zeros((), dtype=torch.float64),) * 3
    low, high, sites, tokens = math.inf, -math.inf, 0, 0
    for row in rows:
        if not row["count"]:
            continue
        # M2 = n * std^2: statistics_rows writes the population std.
        sample = (row["count"], row["mean_deg"], row["count"] * row["std_deg"] ** 2)
        moments = chan_merge(*moments, *(torch.tensor(float(v), dtype=torch.float64) for v in sample))
        low, high = min(low, row["min_deg"]), max(high, row["max_deg"])
        sites, tokens = sites + 1, max(tokens, row["count"] + row["zero_count"])
    count, mean, m2 = (float(m) for m in moments)
    empty = count == 0
    return {
        "sites": sites, "tokens": tokens, "vectors": int(count), "mean_deg": math.nan if empty else mean,
        "std_deg": math.nan if empty else math.sqrt(m2 / count), "min_deg": math.nan if empty else low,
        "max_deg": math.nan if empty else high,
    }


def _rank(known: Sequence[str], value: str) -> tuple[int, str]:
    """Known values in their canonical order, then any others alphabetically."""
    return (known.index(value), "") if value in known else (len(known), value)


def per_norm(rows: Sequence[dict]) -> dict:
    """The per-norm view of rows of one (model, step, site kind, reference): each norm counts once.

    ``norm_abs_dev_deg``: mean over norms of |mean angle - 90|; ``between_norm_std_deg``: population std
    of the per-norm mean angles; their min and max.
    """
    means = np.array([row["mean_deg"] for row in rows if row["count"]], dtype=np.float64)
    if len(means) == 0:
        return dict.fromkeys(("norm_abs_dev_deg", "between_norm_std_deg", "norm_mean_min_deg",
                              "norm_mean_max_deg"), math.nan)
    return {
        "norm_abs_dev_deg": float(np.abs(means - 90.0).mean()),
        "between_norm_std_deg": float(means.std()),
        "norm_mean_min_deg": float(means.min()),
        "norm_mean_max_deg": float(means.max()),
    }


def null_pooled(null_rows: Sequence[dict]) -> dict:
    """1 among the K random directions, over the norms of one (model, step, site kind).

    ``ones_pooled_rank_pct``: percentile rank (as in ``null.jsonl``) of 1's token-pooled mean angle among
    the K null directions' token-pooled means; ``norms_in_null_band``: at how many norms 1's mean lies
    inside the null directions' 5-95% band.
    """
    counts = np.array([row["count"] for row in null_rows], dtype=np.float64)
    ones = float((counts * np.array([row["mean_deg"] for row in null_rows])).sum() / counts.sum())
    null = (counts[:, None] * np.array([row["null_means"] for row in null_rows], dtype=np.float64)).sum(0)
    null /= counts.sum()
    rank = 100.0 * ((null < ones).sum() + 0.5 * (null == ones).sum()) / len(null)
    return {
        "null_k": len(null),
        "ones_pooled_rank_pct": float(rank),
        "norms_in_null_band": sum(bool(row["in_null_band"]) for row in null_rows),
    }


def summarize(rows: Sequence[dict], null_rows: Sequence[dict] | None = None) -> list[dict]:
    """One pooled row per (model, norm, step, site kind, reference), models in the order they appear.

    With ``null_rows`` (``null.jsonl``), the ``ones`` rows also say where 1 stands among random directions.
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        suffix = row["site"].rsplit(".", 1)[-1]
        groups.setdefault((row["model"], row["norm"], row["step"], suffix, row["ref"]), []).append(row)
    null_groups: dict[tuple, list[dict]] = {}
    for row in null_rows or ():
        suffix = row["site"].rsplit(".", 1)[-1]
        null_groups.setdefault((row["model"], row["norm"], row["step"], suffix, "ones"), []).append(row)
    empty_null = {"null_k": None, "ones_pooled_rank_pct": None, "norms_in_null_band": None}
    runs = {run: i for i, run in enumerate(dict.fromkeys(key[:3] for key in groups))}

    def order(key: tuple) -> tuple:
        return runs[key[:3]], _rank(SITE_KINDS, key[3]), _rank(REFERENCE_NAMES, key[4])

    return [
        {
            "model": key[0], "norm": key[1], "step": key[2], "site": key[3], "ref": key[4],
            **pool(groups[key]),
            **per_norm(groups[key]),
            **(null_pooled(null_groups[key]) if key in null_groups else empty_null),
        }
        for key in sorted(groups, key=order)
    ]


def _wide(summary: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the human-readable table: one row per (model, site kind), "mean ± std" per ref."""
    refs = list(dict.fromkeys(row["ref"] for row in summary))
    with_step = any(row["step"] is not None for row in summary)
    header = ["model", "norm", *(["step"] if with_step else []), "site", "norms", "tokens"]
    header += [f"∠ {ref} (deg)" for ref in refs]
    first_ref = len(header)
    short = " / ".join(REF_SHORT.get(ref, ref) for ref in refs)
    header += [f"per norm: mean abs(∠ − 90) ({short})", f"per norm: std of mean ∠ ({short})",
               "1: pct among random (pooled)", "norms with 1 in random 5–95%"]
    lines: dict[tuple, list[str]] = {}
    per_ref: dict[tuple, dict[str, dict]] = {}
    for row in summary:
        key = (row["model"], row["norm"], row["step"], row["site"])
        if key not in lines:
            step = [str(row["step"]) if row["step"] is not None else "-"] if with_step else []
            lines[key] = [row["model"], row["norm"], *step, row["site"], str(row["sites"]),
                          f"{row['tokens']:,}", *["-"] * (len(refs) + 4)]
        lines[key][first_ref - len(refs) + refs.index(row["ref"])] = (
            f"{row['mean_deg']:.2f} ± {row['std_deg']:.2f}"
        )
        per_ref.setdefault(key, {})[row["ref"]] = row
    for key, by_ref in per_ref.items():
        line = lines[key]
        line[first_ref] = " / ".join(_deg(by_ref.get(ref, {}).get("norm_abs_dev_deg")) for ref in refs)
        line[first_ref + 1] = " / ".join(
            _deg(by_ref.get(ref, {}).get("between_norm_std_deg")) for ref in refs
        )
        ones = by_ref.get("ones", {})
        if ones.get("null_k"):
            line[first_ref + 2] = f"{ones['ones_pooled_rank_pct']:.0f}% (K={ones['null_k']})"
            line[first_ref + 3] = f"{ones['norms_in_null_band']}/{ones['sites']}"
    return header, list(lines.values())


REF_SHORT = {"ones": "1", "rand_a": "a", "rand_b": "b"}


def _deg(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def summary_markdown(summary: Sequence[dict]) -> str:
    header, rows = _wide(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    note = (
        "Angle with each reference vector, mean ± std over all tokens and all norms of the model (pooled "
        "exactly: each token counts once per norm, and deviations from 90° of opposite sign at different "
        "norms cancel); site in = before the norm, std = after its standardization (no gain/bias), out = "
        "after it. Per norm: the mean over norms of |mean angle − 90°| and the std of the per-norm mean "
        "angles (between-norm spread), for 1 / rand_a / rand_b. 1: pct among random = percentile rank of "
        "1's pooled mean angle among the K random directions' pooled means; norms with 1 in random 5–95% "
        "= norms where 1's mean angle lies inside the random directions' 5th-95th percentile band."
    )
    return note + "\n\n" + "\n".join(lines) + "\n"


def summary_csv(summary: Sequence[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=SUMMARY_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(summary)
    return buffer.getvalue()


def write_summary(out_dir: str | Path, summary: Sequence[dict]) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / SUMMARY_CSV, summary_csv(summary))
    atomic_write_text(out_dir / SUMMARY_MD, summary_markdown(summary))
    return out_dir / SUMMARY_CSV, out_dir / SUMMARY_MD


def _narrow(summary: Sequence[dict]) -> list[tuple[str, list[tuple[str, list[str], list[list[str]]]]]]:
    """The console's tables, two per model so that each fits 80 columns with every number whole:
    (the model's line, [(title, header, rows) of the angles, of the per-norm view]). The model, its norm,
    norm count and tokens go in the model's line; summary.md keeps the one wide table."""
    refs = list(dict.fromkeys(row["ref"] for row in summary))
    short = [REF_SHORT.get(ref, ref) for ref in refs]
    with_step = any(row["step"] is not None for row in summary)
    lead = ["step", "site"] if with_step else ["site"]
    blocks: dict[tuple, dict[tuple, dict[str, dict]]] = {}
    for row in summary:
        lines = blocks.setdefault((row["model"], row["norm"]), {})
        lines.setdefault((row["step"], row["site"]), {})[row["ref"]] = row
    models = []
    for (model, norm), lines in blocks.items():
        rows = [row for by_ref in lines.values() for row in by_ref.values()]
        null_k = max((row["null_k"] or 0 for row in rows), default=0)
        angles, spread = [], []
        for (step, site), by_ref in lines.items():
            start = ([str(step) if step is not None else "-"] if with_step else []) + [site]
            ones = by_ref.get("ones", {})
            known = bool(ones.get("null_k"))
            angles.append([
                *start,
                *(f"{by_ref[ref]['mean_deg']:.2f} ± {by_ref[ref]['std_deg']:.2f}" if ref in by_ref else "-"
                  for ref in refs),
                f"{ones['ones_pooled_rank_pct']:.0f}%" if known else "-",
            ])
            spread.append([
                *start,
                *(_deg(by_ref.get(ref, {}).get("norm_abs_dev_deg")) for ref in refs),
                *(_deg(by_ref.get(ref, {}).get("between_norm_std_deg")) for ref in refs),
                f"{ones['norms_in_null_band']}/{ones['sites']}" if known else "-",
            ])
        norms = max(row["sites"] for row in rows)
        tokens = max(row["tokens"] for row in rows)
        among = f"K={null_k} random directions" if null_k else "the random directions"
        models.append((f"{model} ({norm}, {norms} norms, {tokens:,} tokens)", [
            (f"angle with {', '.join(short)} (deg): mean ± std over tokens and norms; 1 pct: 1's percentile "
             f"among {among}", [*lead, *(f"∠ {s}" for s in short), "1 pct"], angles),
            ("per norm (deg): dev = mean |∠ − 90|, sd = std of the mean ∠; 1 in band: norms where 1 lies in "
             "the random directions' 5–95% band",
             [*lead, *(f"dev {s}" for s in short), *(f"sd {s}" for s in short), "1 in band"], spread),
        ]))
    return models


def print_summary(summary: Sequence[dict], title: str = "Angles before/after the norms", *, file=None,
                  width: int | None = None) -> None:
    """The summary on the console: readable at 80 columns (:func:`_narrow`); the one wide table is
    summary.md's."""
    print(title, file=file or sys.stdout)
    for model, tables in _narrow(summary):
        print(f"\n{model}", file=file or sys.stdout)
        for caption, header, rows in tables:
            print_table(header, rows, title=caption, left=("step", "site"), file=file, width=width)

