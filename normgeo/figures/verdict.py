"""The verdict's figures, and the verdict written: ``verdict.{png,pdf}`` (the tested rows' per-seed values,
means, 95%/90% intervals and margins) and ``val_curve_diff.{png,pdf}`` (each contrast's paired difference of
the validation curves); :func:`write_verdict` writes them with ``verdict.md`` and ``verdict.csv``. What the
verdict computes is :mod:`normgeo.verdict`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from corpus.atomic import atomic_write_text
from normgeo.figures.style import arm_color, norm_label, save_figure
from normgeo.figures.sweep import Comparison
from normgeo.measure.stats import mean_t_interval
from normgeo.verdict.declared import VerdictConfig, load_verdict_config
from normgeo.verdict.families import Estimate, Pairing, downstream_mismatches, paired_estimates, pairings
from normgeo.verdict.measures import VAL_TAIL, run_measures, validation_curve
from normgeo.verdict.words import contrast_text, verdict_markdown, verdict_table

VERDICT_CSV = "verdict.csv"
VERDICT_MD = "verdict.md"
CURVE_FIGURE = "val_curve_diff"


def verdict_figure(estimates: Sequence[Estimate], out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """Per tested metric a panel: each tested row's per-seed values (dots), mean with its 95% (thin) and 90%
    (thick) intervals, and the ±margin (grey band)."""
    tested = [e for e in estimates if e.tested and e.n]
    panels = list(dict.fromkeys(e.metric for e in tested))
    if not panels:
        return []
    rows = list(dict.fromkeys(contrast_text(e, where=True) for e in tested))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.45 * len(rows) + 1.6),
                             sharey=True, squeeze=False, layout="constrained")
    for ax, name in zip(axes[0], panels, strict=True):
        for est in (e for e in tested if e.metric == name):
            y = rows.index(contrast_text(est, where=True))
            color = arm_color(est.arm, 0)
            ax.plot(est.values, [y] * est.n, "o", ms=3.5, color=color, alpha=0.5)
            if est.ci95 is not None:
                ax.plot(est.ci95, [y, y], "-", lw=1.0, color=color)
                ax.plot(est.ci90, [y, y], "-", lw=3.0, color=color)
            ax.plot([est.mean], [y], "D", ms=6, color=color, markeredgecolor="black", markeredgewidth=0.6)
            ax.axvspan(-est.margin, est.margin, color="gray", alpha=0.15, lw=0)
        ax.axvline(0.0, color="gray", lw=0.9, ls="--")
        ax.set_title(f"{tested[[e.metric for e in tested].index(name)].about.text}\narm − other", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_yticks(range(len(rows)), rows, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle(
        "Declared questions over seeds · dots: seeds, diamond: mean, bars: 95% (thin) and 90% (thick) "
        "t-intervals, grey: ±margin"
    )
    return save_figure(fig, out_dir, "verdict", formats)


def curve_differences(comparison: Comparison, pairing: Pairing) -> pd.DataFrame:
    """Per validation step common to a contrast's runs: the per-seed differences arm − other of the
    validation loss, their mean and pointwise 95% t-interval (columns step, n, mean, low, high)."""
    curves = {run: validation_curve(comparison.metrics[comparison.metrics["run"] == run])
              for run in pairing.arm_runs + pairing.other_runs}
    diffs = [curves[a] - curves[b] for a, b in zip(pairing.arm_runs, pairing.other_runs, strict=True)]
    table = pd.concat(diffs, axis=1).dropna(how="all") if diffs else pd.DataFrame()
    rows = []
    for step, values in table.iterrows():
        values = values.dropna()
        if values.empty:
            continue
        mean, low, high = mean_t_interval(list(values))
        rows.append({"step": int(step), "n": len(values), "mean": mean, "low": low, "high": high})
    return pd.DataFrame(rows, columns=["step", "n", "mean", "low", "high"])


def curve_figure(comparison: Comparison, found: Sequence[Pairing], config: VerdictConfig, out_dir: Path,
                 formats: Sequence[str]) -> list[Path]:
    """Per contrast a panel: the paired difference of the whole validation curve (arm − other per seed,
    thin), its mean (thick) with a pointwise 95% t-interval, the ±margin band and the tail window."""
    panels = [(p, curve_differences(comparison, p)) for p in found]
    panels = [(p, table) for p, table in panels if not table.empty]
    if not panels:
        return []
    columns = min(4, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False,
                             layout="constrained")
    margin = config.margin("val_loss")
    for ax, (pairing, table) in zip(axes.flat, panels, strict=False):
        color = arm_color(pairing.arm, 0)
        for a, b in zip(pairing.arm_runs, pairing.other_runs, strict=True):
            metrics = comparison.metrics
            diff = (
                validation_curve(metrics[metrics["run"] == a])
                - validation_curve(metrics[metrics["run"] == b])
            ).dropna()
            ax.plot(diff.index, diff.values, "-", lw=0.7, color=color, alpha=0.35)
        ax.plot(table["step"], table["mean"], "-", lw=2.0, color=color)
        has = table["low"].notna()
        ax.fill_between(table["step"][has], table["low"][has].astype(float), table["high"][has].astype(float),
                        color=color, alpha=0.2, lw=0)
        ax.axhspan(-margin, margin, color="gray", alpha=0.15, lw=0)
        ax.axhline(0.0, color="gray", lw=0.9, ls="--")
        tail = max(1, math.ceil(VAL_TAIL * len(table) - 1e-9))
        ax.axvline(table["step"].iloc[-tail], color="black", lw=0.7, ls=":")
        where = " ".join(x for x in (pairing.size, "post" if pairing.placement == "post" else "") if x)
        ax.set_title(
            f"{norm_label(pairing.arm)} − {norm_label(pairing.other)}"
            + (f" ({where})" if where else "")
            + f", {len(pairing.seeds)} seed{'s' if len(pairing.seeds) != 1 else ''}",
            fontsize=9,
        )
        ax.set_xlabel("step")
        ax.set_ylabel("Δ validation loss (nats)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Paired difference of the validation curves · thin: seeds, thick: mean with pointwise 95% "
                 f"t-interval, grey: ±{margin:g} nats, dotted: start of the last 20% (the primary statistic)")
    return save_figure(fig, out_dir, CURVE_FIGURE, formats)


def write_verdict(comparison: Comparison, out_dir: Path, formats: Sequence[str] = ("png",),
                  config: VerdictConfig | None = None) -> list[Path]:
    """verdict.md, verdict.csv, the verdict figure and the curve-difference figure into ``out_dir``."""
    config = config or load_verdict_config()
    measures = run_measures(comparison)
    estimates, unpaired = paired_estimates(measures, config)
    found, _ = pairings(measures)
    atomic_write_text(out_dir / VERDICT_MD, verdict_markdown(estimates, measures, unpaired, config,
                                                             downstream_mismatches(measures)))
    atomic_write_text(out_dir / VERDICT_CSV, verdict_table(estimates).to_csv(index=False))
    return [out_dir / VERDICT_MD, out_dir / VERDICT_CSV, *verdict_figure(estimates, out_dir, formats),
            *curve_figure(comparison, found, config, out_dir, formats)]
