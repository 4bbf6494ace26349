"""Figures of the norm factorial, drawn by ``normgeo.compare`` (and by ``normgeo.report`` for several runs):

- ``ellipsoid.{png,pdf}``: per arm, the condition number (largest / smallest principal semi-axis) of every
  norm's output ellipsoid (``ellipsoid.jsonl``, Riechers' hyperellipsoid for LayerNorm) against the step;
- ``energy.{png,pdf}``: per arm, the fraction of each norm input's energy along 1 (what LayerNorm's
  centering removes; line: mean over tokens, band: p25-p75) and the Jacobian scale proxy sqrt(d)/||x||;
- ``factorial_ones.{png,pdf}``: every arm's angle with 1 before and after the norms (mean over the norms of
  each site kind) on one figure, each arm labelled with its final validation loss.

Each arm's title or label carries its last validation loss: the practical claim under test is that
dropping mean subtraction costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from normgeo.figures.style import (
    POST_SUFFIX,
    SITE_STYLE,
    arm_color,
    arm_label,
    finish_axes,
    layer_key,
    save_figure,
)
from normgeo.figures.sweep import Comparison, load, records_frame
from normgeo.readers.metrics_csv import last_value
from normgeo.run_folder import ELLIPSOID_FILE, ENERGY_FILE

ENERGY_LABELS = {
    "ones_fraction": "energy along 1, cos²(x, 1)\n(removed by centering)",
    "jacobian_proxy": "Jacobian scale proxy √d / ‖x‖",
}


def _arm_title(comparison: Comparison, arm: str) -> str:
    loss = last_value(comparison.metrics[comparison.metrics["arm"] == arm], "val/loss")
    return arm_label(arm) + (f" · val loss {loss:.3f}" if loss is not None else "")


def _site_order(frame: pd.DataFrame) -> list[tuple[str, str]]:
    pairs = frame[["layer", "site"]].drop_duplicates().itertuples(index=False)
    return sorted(((p.layer, p.site) for p in pairs), key=lambda p: (layer_key(p[0]), p[1]))


def _per_arm_panels(comparison, frame: pd.DataFrame, quantities: Sequence[tuple[str, str, str]], stem: str,
                    title: str, out_dir: Path, formats: Sequence[str], log: bool = True) -> list[Path]:
    """Rows: (column to filter or None, value, y label); columns: arms; one line per (layer, site)."""
    arms = sorted(frame["arm"].unique())
    fig, axes = plt.subplots(len(quantities), len(arms), figsize=(4.2 * len(arms), 3.1 * len(quantities)),
                             sharex=True, sharey="row", squeeze=False, layout="constrained")
    sites = _site_order(frame)
    for col, arm in enumerate(arms):
        of_arm = frame[frame["arm"] == arm]
        for row, (quantity, value, ylabel) in enumerate(quantities):
            ax = axes[row][col]
            chosen = of_arm if quantity is None else of_arm[of_arm["quantity"] == quantity]
            for index, (layer, site) in enumerate(sites):
                series = (
                    chosen[(chosen["layer"] == layer) & (chosen["site"] == site)]
                    .groupby("step")
                    .mean(numeric_only=True)
                )
                if series.empty or series[value].isna().all():
                    continue
                label = f"{'final' if layer == 'final' else 'layer ' + layer} {site}"
                ax.plot(series.index, series[value], "o-", ms=2.5, lw=1.1, color=f"C{index}", label=label)
                if quantity is not None and "p25" in series:
                    ax.fill_between(
                        series.index, series["p25"], series["p75"], color=f"C{index}", alpha=0.15, lw=0
                    )
            if log:  # energies span many decades; a condition number stays near 1
                ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            if col == 0:
                ax.set_ylabel(ylabel)
            if row == 0:
                ax.set_title(_arm_title(comparison, arm), fontsize=9)
            if row == len(quantities) - 1:
                ax.set_xlabel("training step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:  # the legend of the panel with the most curves (an RMS arm has no hyperplane)
        if len(ax.get_legend_handles_labels()[1]) > len(labels):
            handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncol=min(len(labels), 5))
    fig.suptitle(title)
    return save_figure(fig, out_dir, stem, formats)


def ellipsoid_figure(comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    frame = records_frame(comparison, ELLIPSOID_FILE)
    if frame.empty:
        return []
    condition = (None, "condition", "condition number\n(largest / smallest semi-axis)")
    return _per_arm_panels(
        comparison, frame, [condition], "ellipsoid",
        "Each norm's output ellipsoid (from its gain; LayerNorm: Riechers' (d−1)-dim hyperellipsoid)",
        out_dir, formats, log=False)


def energy_figure(comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    frame = records_frame(comparison, ENERGY_FILE)
    if frame.empty:
        return []
    return _per_arm_panels(
        comparison, frame, [(name, "mean", label) for name, label in ENERGY_LABELS.items()], "energy",
        "At every norm input, per token · line: mean over tokens, band: p25–p75", out_dir, formats,
    )


def factorial_figure(comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """The arms' angle with 1 against the step on one figure: before the norms and after them."""
    angles = comparison.angles[comparison.angles["ref"] == "ones"]
    if angles.empty:
        return []
    kinds = angles["site"].str.rpartition(".")[2]
    suffixes = [s for s in SITE_STYLE if (kinds == s).any()]
    fig, axes = plt.subplots(1, len(suffixes), figsize=(5.4 * len(suffixes), 4), squeeze=False,
                             layout="constrained")
    for ax, suffix in zip(axes[0], suffixes, strict=True):
        of_kind = angles[kinds == suffix]
        for index, arm in enumerate(sorted(of_kind["arm"].unique())):
            # Mean over the norms (layers and roles) and seeds of each run's mean over tokens.
            curve = of_kind[of_kind["arm"] == arm].groupby("step")[["mean_deg", "p05", "p95"]].mean()
            # Post-LN dashed
            color, style = arm_color(arm, index), "s--" if arm.endswith(POST_SUFFIX) else "o-"
            ax.plot(curve.index, curve["mean_deg"], style, ms=3, lw=1.3, color=color,
                    label=_arm_title(comparison, arm))
            ax.fill_between(curve.index, curve["p05"], curve["p95"], color=color, alpha=0.1, lw=0)
        finish_axes(ax, "training step", "angle with 1 (degrees)",
                    f"{SITE_STYLE[suffix][1]} (mean over the norms)", line=90, legend=7)
    fig.suptitle("The norm factorial: angle with the uniform vector 1 · band: mean of the per-norm p05–p95")
    return save_figure(fig, out_dir, "factorial_ones", formats)


NORM_FIGURES = {"ellipsoid": ellipsoid_figure, "energy": energy_figure, "factorial": factorial_figure}


def write_norm_figures(
    run_dirs: Sequence[Path], out_dir: Path, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """The factorial figures for ``run_dirs`` (used by ``normgeo.report`` with several runs)."""
    comparison = load(run_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [path for maker in NORM_FIGURES.values() for path in maker(comparison, out_dir, formats)]
