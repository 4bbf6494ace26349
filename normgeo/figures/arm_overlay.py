"""Loading a sweep's runs into tidy tables and drawing the arms on the same axes (see
:mod:`normgeo.compare`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib.pyplot as plt

from corpus.atomic import TMP_SUFFIX
from normgeo.figures.intervention_panels import plot_intervention_steps
from normgeo.figures.norm_figures import NORM_FIGURES
from normgeo.figures.style import REF_LABELS, arm_color, arm_label, finish_axes, layer_key, save_figure
from normgeo.figures.sweep import Comparison, load, markdown, records_frame, summary_table
from normgeo.figures.verdict import write_verdict
from normgeo.measure.records import DamagedRecords
from normgeo.run_folder import INTERVENTION_FILE
from normgeo.verdict.declared import VerdictConfig

FigureMaker = Callable[[Comparison, Path, Sequence[str]], list[Path]]
FIGURES: dict[str, FigureMaker] = {}


def register_figure(name: str) -> Callable[[FigureMaker], FigureMaker]:
    """Add a figure kind to ``normgeo.figures.arm_overlay`` (called with the comparison, the out dir and
    formats)."""

    def add(maker: FigureMaker) -> FigureMaker:
        FIGURES[name] = maker
        return maker

    return add


# --- figures ----------------------------------------------------------------------------------------------


@register_figure("overlay")
def overlay_figures(comparison: Comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """Per site and reference: the arms over training steps, one panel per layer, p05-p95 bands."""
    angles = comparison.angles
    arms = list(dict.fromkeys(sorted(angles["arm"])))
    seeds = angles.groupby("arm")["seed"].nunique().to_dict()
    paths = []
    # Mean over seeds of each run's statistics (a run's p05/p95 are over its probe tokens).
    curves = angles.groupby(["site", "ref", "layer", "arm", "step"], sort=False)[
        ["mean_deg", "p05", "p95"]
    ].mean()
    for (site, ref), group in curves.groupby(level=["site", "ref"], sort=False):
        layers = sorted(group.index.get_level_values("layer").unique(), key=layer_key)
        ncols = min(4, len(layers))
        nrows = -(-len(layers) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.8 * nrows), sharex=True, sharey=True,
                                 layout="constrained", squeeze=False)
        for ax, layer in zip(axes.flat, layers, strict=False):
            for index, arm in enumerate(arms):
                try:
                    series = group.xs((layer, arm), level=["layer", "arm"]).reset_index().sort_values("step")
                except KeyError:
                    continue
                color = arm_color(arm, index)
                label = arm_label(arm) + (f" ({seeds[arm]} seeds)" if seeds.get(arm, 1) > 1 else "")
                ax.plot(series["step"], series["mean_deg"], "o-", ms=3, lw=1.2, color=color, label=label)
                ax.fill_between(series["step"], series["p05"], series["p95"], color=color, alpha=0.18, lw=0)
            ax.set_title(f"layer {layer}" if layer != "final" else "final norm", fontsize=9)
            finish_axes(ax, line=90)
        for ax in axes.flat[len(layers):]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("training step")
        for ax in axes[:, 0]:
            ax.set_ylabel("angle (degrees)")
        axes.flat[0].legend(fontsize=7, loc="best")
        fig.suptitle(f"{site}: angle with {REF_LABELS.get(ref, ref)} · line: mean over tokens, band: p05–p95")
        paths += save_figure(fig, out_dir, f"overlay_{site}_{ref}", formats)
    return paths


@register_figure("loss")
def loss_figure(comparison: Comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """Every arm's train loss (mean over seeds, each seed thin) and validation loss on one figure."""
    metrics = comparison.metrics
    if metrics.empty:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    for index, arm in enumerate(sorted(metrics["arm"].unique())):
        color = arm_color(arm, index)
        of_arm = metrics[metrics["arm"] == arm]
        train = of_arm[of_arm["metric"] == "train/loss"]
        if not train.empty:
            if train["seed"].nunique() > 1:
                for _, seed_rows in train.groupby("seed"):
                    seed_rows = seed_rows.sort_values("step")
                    ax.plot(seed_rows["step"], seed_rows["value"], color=color, lw=0.5, alpha=0.4)
            mean = train.groupby("step")["value"].mean()
            ax.plot(mean.index, mean.values, color=color, lw=1.5, label=f"{arm_label(arm)} train")
        val = of_arm[of_arm["metric"] == "val/loss"].groupby("step")["value"].mean()
        if not val.empty:
            ax.plot(val.index, val.values, "s--", color=color, ms=5, lw=1,
                    label=f"{arm_label(arm)} validation")
    finish_axes(ax, "training step", "cross-entropy loss (nats)", "train and validation loss per arm",
                legend=8)
    return save_figure(fig, out_dir, "loss", formats)


@register_figure("intervention")
def intervention_figure(comparison: Comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """The centering intervention (all norms at once) over training per arm: Δ loss of removing
    LayerNorm's mean subtraction, of adding it to RMSNorm."""
    frame = records_frame(comparison, INTERVENTION_FILE)
    if frame.empty:
        return []
    runs = [(str(arm), group.to_dict("records")) for (_, arm), group in frame.groupby(["run", "arm"])]
    return plot_intervention_steps(runs, out_dir, formats)


# --- command ----------------------------------------------------------------------------------------------


def write_comparison(
    paths: Sequence[Path],
    out_dir: Path,
    formats: Sequence[str] = ("png", "pdf"),
    refs: Sequence[str] | None = None,
    verdict_config: VerdictConfig | None = None,
) -> tuple[dict[str, list[Path]], list[DamagedRecords]]:
    """Tables and figures for the runs under ``paths`` into ``out_dir``; returns what was written and the
    runs left out because a records file is damaged (the others are compared). ``verdict_config``: the
    verdict's margins and primary question (default: ``conf/compare/margins.yaml``)."""
    comparison = load(paths)
    if refs:
        held = sorted(set(comparison.angles["ref"]))
        if unknown := [ref for ref in refs if ref not in held]:
            raise ValueError(f"--refs={','.join(refs)}: no records of {', '.join(unknown)}; the runs hold "
                             f"{', '.join(held)}")
        comparison.angles = comparison.angles[comparison.angles["ref"].isin(refs)]
    # Everything is drawn into a hidden staging folder first and moved in only when all of it is written:
    # a failure half-way leaves out_dir as it was (and no out_dir it would have created).
    created = not out_dir.exists()
    # Named first and made inside the try: a signal landing just after a mkdir still finds it removed.
    staging = out_dir / f".compare.{os.getpid()}{TMP_SUFFIX}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed process that had this PID
        staging.mkdir()
        written: dict[str, list[Path]] = {"tables": []}
        for name, frame in (("angles", comparison.angles), ("metrics", comparison.metrics)):
            frame.to_parquet(staging / f"{name}.parquet", index=False)
            frame.to_csv(staging / f"{name}.csv", index=False)
            written["tables"] += [staging / f"{name}.parquet", staging / f"{name}.csv"]
        summary = summary_table(comparison)
        summary.to_csv(staging / "summary.csv", index=False)
        (staging / "summary.md").write_text(markdown(summary))
        written["tables"] += [staging / "summary.csv", staging / "summary.md"]
        for name, maker in FIGURES.items():
            written[name] = maker(comparison, staging, formats)
        written["verdict"] = write_verdict(comparison, staging, formats, verdict_config)
        for path in staging.iterdir():
            os.replace(path, out_dir / path.name)
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: [out_dir / p.name for p in paths] for name, paths in written.items()}, comparison.damaged


# The norm factorial's figures (ellipsoid, energy along 1, all arms' angle with 1): same path, own module.
for _name, _maker in NORM_FIGURES.items():
    register_figure(_name)(_maker)
