"""Loading a sweep's runs into tidy tables and drawing the arms on the same axes (see :mod:`normgeo.compare`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from normgeo.figures.angles import NORM_LABELS, REF_LABELS  # noqa: E402
from normgeo.measure.records import ANGLES_FILE, read_rows  # noqa: E402
from normgeo.runs.metrics import read_metrics  # noqa: E402

SUMMARY_FILE = "summary.json"  # written by train.py at the end of a run
ARM_COLORS = {"layer": "tab:blue", "rms": "tab:red", "layer_nobias": "tab:cyan", "rms_bias": "tab:orange"}
POST_SUFFIX = "+post"  # appended to the arm of a placement=post run: "layer+post"


@dataclass
class Comparison:
    """What the figures are drawn from: the tidy tables of all runs."""

    angles: pd.DataFrame  # angles.jsonl rows + run, arm, seed, size
    metrics: pd.DataFrame  # run, arm, seed, step, metric, value
    runs: pd.DataFrame  # one row per run: run, arm, seed, size, max_steps, tokens_per_step, run_dir


FigureMaker = Callable[[Comparison, Path, Sequence[str]], list[Path]]
FIGURES: dict[str, FigureMaker] = {}


def register_figure(name: str) -> Callable[[FigureMaker], FigureMaker]:
    """Add a figure kind to ``normgeo.figures.compare`` (called with the comparison, the out dir and formats)."""

    def add(maker: FigureMaker) -> FigureMaker:
        FIGURES[name] = maker
        return maker

    return add


# --- loading ---------------------------------------------------------------------------------------------


def run_directories(paths: Sequence[Path]) -> list[Path]:
    """Training run directories at or below ``paths`` (analyze.py folders left out)."""
    from normgeo.runs.status import find_runs, is_analysis

    found: list[Path] = []
    for path in paths:
        if (path / ANGLES_FILE).is_file() and not (path / ".hydra").is_dir():
            found.append(path)  # a copied run without Hydra's files
            continue
        found += [run for run in find_runs(path) if not is_analysis(run) and (run / ANGLES_FILE).is_file()]
    return sorted(dict.fromkeys(p.resolve() for p in found))


def run_config(run_dir: Path) -> dict:
    """The run's resolved config: run_config.yaml (train.py's record), else Hydra's config.yaml."""
    for path in (run_dir / "run_config.yaml", run_dir / ".hydra" / "config.yaml"):
        if path.is_file():
            return yaml.safe_load(path.read_text()) or {}
    return {}


def load(paths: Sequence[Path]) -> Comparison:
    runs, angle_frames, metric_frames = [], [], []
    for run_dir in run_directories(paths):
        config = run_config(run_dir)
        rows = read_rows(run_dir / ANGLES_FILE)
        norm = (config.get("norm") or {}).get("name") or rows[0]["norm"]
        placement = (config.get("placement") or {}).get("name") or "pre"  # runs older than the key: pre
        info = {
            "run": config.get("run_name") or run_dir.name,
            "arm": norm + (POST_SUFFIX if placement == "post" else ""),
            "placement": placement,
            "seed": config.get("seed"),
            "size": (config.get("size") or {}).get("name"),
        }
        tokens_per_step = (config.get("global_batch") or 0) * (config.get("seq_len") or 0) or None
        runs.append({**info, "max_steps": config.get("max_steps"), "tokens_per_step": tokens_per_step,
                     "run_dir": str(run_dir)})
        angles = pd.DataFrame(rows)
        angles = angles[angles["step"].notna()]  # a run's own records all have steps
        angles["layer"] = angles["layer"].astype(str)  # block indices and "final" in one column
        angle_frames.append(angles.assign(**info))
        metrics = read_metrics(run_dir)
        if not metrics.empty:
            metric_frames.append(align_train_steps(metrics, tokens_per_step).assign(**info))
    if not runs:
        raise FileNotFoundError(f"no training runs with {ANGLES_FILE} under {', '.join(map(str, paths))}")
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
    return Comparison(angles=angles, metrics=metrics[order + ["step", "metric", "value"]], runs=runs_frame)


def align_train_steps(metrics: pd.DataFrame, tokens_per_step: int | None) -> pd.DataFrame:
    """train/* metrics at the optimizer step they describe (tokens_seen / tokens per step).

    Lightning logs a step's loss before its optimizer step counter advances, so older runs hold the k-th
    update's loss at step k-1; the probe of the weights after that update is recorded at step k.
    """
    tokens = metrics[metrics["metric"] == "train/tokens_seen"].set_index("step")["value"]
    if tokens.empty or not tokens_per_step:
        return metrics
    shift = {int(step): int(round(value / tokens_per_step)) for step, value in tokens.items()}
    train = metrics["metric"].str.startswith("train/") | metrics["metric"].str.startswith("perf/")
    metrics = metrics.copy()
    metrics.loc[train, "step"] = [shift.get(int(s), int(s)) for s in metrics.loc[train, "step"]]
    return metrics


# --- summary ----------------------------------------------------------------------------------------------


def summary_table(comparison: Comparison) -> pd.DataFrame:
    """Per arm and seed: final step and losses, tokens, wall time, mean angle with 1 per site (final step)."""
    records = []
    for run in comparison.runs.itertuples():
        angles = comparison.angles[comparison.angles["run"] == run.run]
        final = int(angles["step"].max())
        metrics = comparison.metrics[comparison.metrics["run"] == run.run]
        saved = Path(run.run_dir) / SUMMARY_FILE
        end = json.loads(saved.read_text()) if saved.is_file() else {}
        record = {
            "arm": run.arm,
            "seed": run.seed,
            "run": run.run,
            "final_step": final,
            "tokens": final * run.tokens_per_step if run.tokens_per_step else None,
            "train_loss": _last(metrics, "train/loss"),
            "val_loss": _last(metrics, "val/loss"),
            "wall_s": end.get("wall_s"),
            "tokens_per_s": end.get("tokens_per_s"),
        }
        at_final = angles[(angles["step"] == final) & (angles["ref"] == "ones")]
        for site, mean in at_final.groupby("site", sort=False)["mean_deg"].mean().items():
            record[f"ones_deg/{site}"] = float(mean)
        records.append(record)
    return pd.DataFrame(records).sort_values(["arm", "seed"], kind="stable").reset_index(drop=True)


def _last(metrics: pd.DataFrame, metric: str) -> float | None:
    values = metrics[metrics["metric"] == metric].sort_values("step")["value"]
    return None if values.empty else float(values.iloc[-1])


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


# --- figures ----------------------------------------------------------------------------------------------


def _save(fig, out_dir: Path, stem: str, formats: Sequence[str]) -> list[Path]:
    paths = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        fig.savefig(path, format=fmt, dpi=110, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def _layer_key(layer: str) -> float:
    return float(layer) if layer.lstrip("-").isdigit() else float("inf")


def _arm_label(arm: str) -> str:
    size, _, norm = arm.removesuffix(POST_SUFFIX).rpartition("-")
    post = " (Post-LN)" if arm.endswith(POST_SUFFIX) else ""
    return f"{size} {NORM_LABELS.get(norm, norm)}{post}".strip()


def _arm_color(arm: str, index: int) -> str:
    return ARM_COLORS.get(arm.removesuffix(POST_SUFFIX).rpartition("-")[2], f"C{index + 2}")


@register_figure("overlay")
def overlay_figures(comparison: Comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """Per site and reference: the arms over training steps, one panel per layer, p05-p95 bands."""
    angles = comparison.angles
    arms = list(dict.fromkeys(sorted(angles["arm"])))
    seeds = angles.groupby("arm")["seed"].nunique().to_dict()
    paths = []
    # Mean over seeds of each run's statistics (a run's p05/p95 are over its probe tokens).
    curves = angles.groupby(["site", "ref", "layer", "arm", "step"], sort=False)[["mean_deg", "p05", "p95"]].mean()
    for (site, ref), group in curves.groupby(level=["site", "ref"], sort=False):
        layers = sorted(group.index.get_level_values("layer").unique(), key=_layer_key)
        ncols = min(4, len(layers))
        nrows = -(-len(layers) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.8 * nrows), sharex=True, sharey=True, layout="constrained",
                                 squeeze=False)
        for ax, layer in zip(axes.flat, layers, strict=False):
            for index, arm in enumerate(arms):
                try:
                    series = group.xs((layer, arm), level=["layer", "arm"]).reset_index().sort_values("step")
                except KeyError:
                    continue
                color = _arm_color(arm, index)
                label = _arm_label(arm) + (f" ({seeds[arm]} seeds)" if seeds.get(arm, 1) > 1 else "")
                ax.plot(series["step"], series["mean_deg"], "o-", ms=3, lw=1.2, color=color, label=label)
                ax.fill_between(series["step"], series["p05"], series["p95"], color=color, alpha=0.18, lw=0)
            ax.axhline(90, color="gray", lw=0.8, ls="--")
            ax.set_title(f"layer {layer}" if layer != "final" else "final norm", fontsize=9)
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(layers):]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("training step")
        for ax in axes[:, 0]:
            ax.set_ylabel("angle (degrees)")
        axes.flat[0].legend(fontsize=7, loc="best")
        fig.suptitle(f"{site}: angle with {REF_LABELS.get(ref, ref)} · line: mean over tokens, band: p05–p95")
        paths += _save(fig, out_dir, f"overlay_{site}_{ref}", formats)
    return paths


@register_figure("loss")
def loss_figure(comparison: Comparison, out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """Every arm's train loss (mean over seeds, each seed thin) and validation loss on one figure."""
    metrics = comparison.metrics
    if metrics.empty:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    for index, arm in enumerate(sorted(metrics["arm"].unique())):
        color = _arm_color(arm, index)
        of_arm = metrics[metrics["arm"] == arm]
        train = of_arm[of_arm["metric"] == "train/loss"]
        if not train.empty:
            if train["seed"].nunique() > 1:
                for _, seed_rows in train.groupby("seed"):
                    seed_rows = seed_rows.sort_values("step")
                    ax.plot(seed_rows["step"], seed_rows["value"], color=color, lw=0.5, alpha=0.4)
            mean = train.groupby("step")["value"].mean()
            ax.plot(mean.index, mean.values, color=color, lw=1.5, label=f"{_arm_label(arm)} train")
        val = of_arm[of_arm["metric"] == "val/loss"].groupby("step")["value"].mean()
        if not val.empty:
            ax.plot(val.index, val.values, "s--", color=color, ms=5, lw=1, label=f"{_arm_label(arm)} validation")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title("train and validation loss per arm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "loss", formats)


# --- command ----------------------------------------------------------------------------------------------


def write_comparison(
    paths: Sequence[Path], out_dir: Path, formats: Sequence[str] = ("png", "pdf"), refs: Sequence[str] | None = None
) -> dict[str, list[Path]]:
    """Tables and figures for the runs under ``paths`` into ``out_dir``; returns what was written."""
    comparison = load(paths)
    if refs:
        comparison.angles = comparison.angles[comparison.angles["ref"].isin(refs)]
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {"tables": []}
    for name, frame in (("angles", comparison.angles), ("metrics", comparison.metrics)):
        frame.to_parquet(out_dir / f"{name}.parquet", index=False)
        frame.to_csv(out_dir / f"{name}.csv", index=False)
        written["tables"] += [out_dir / f"{name}.parquet", out_dir / f"{name}.csv"]
    summary = summary_table(comparison)
    summary.to_csv(out_dir / "summary.csv", index=False)
    (out_dir / "summary.md").write_text(markdown(summary))
    written["tables"] += [out_dir / "summary.csv", out_dir / "summary.md"]
    for name, maker in FIGURES.items():
        written[name] = maker(comparison, out_dir, formats)
    return written


# The norm factorial's figures (ellipsoid, energy along 1, all arms' angle with 1): same path, own module.
from normgeo.figures.norm_figures import NORM_FIGURES  # noqa: E402

for _name, _maker in NORM_FIGURES.items():
    register_figure(_name)(_maker)
