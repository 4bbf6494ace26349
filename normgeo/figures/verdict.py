"""The verdict of a sweep: paired contrasts of the norm arms over seeds, and what they support.

Runs of the same size, placement and seed are paired across arms: they share the initial non-norm
weights and every batch, so the per-seed difference removes most of the seed's own noise. For each
contrast of the norm registry (:func:`models.norms.contrasts`: ``layer`` vs ``rms``, ``layer_nobias`` vs
``rms``, ``layer`` vs ``rms_bias``, ``layer`` vs ``layer_nobias``, every arm vs ``dyt``) whose two arms are
both present, per (size, placement), the verdict reports the per-seed differences (arm minus other) and
their mean with a two-sided 95% Student-t interval over seeds of:

- ``val_loss``: the final validation loss;
- ``tokens_per_s_ratio``: training tokens/s as a ratio arm / other (the interval is computed on the
  log-ratio and exponentiated: a geometric mean). A run's tokens/s is the median over its optimizer steps
  of the logged per-step throughput (``perf/tokens_per_s``): the few steps that include a probe, a
  validation or a checkpoint, and bursts of load on a shared machine, do not move a median the way they
  move the wall-clock mean of ``summary.json`` (the fallback for a run with no per-step metric);
- ``ones_dev/<site>``: per site class (``ln1.in``, ``ln2.in``, ``final.in`` and their ``.out``), the mean
  over layers of |angle with 1 - 90 degrees| at the last probed step (the angle is each record's mean
  over tokens).

Per arm it reports the share of (layer, site) records of ``null.jsonl`` where 1 lies inside the null
directions' 5-95% band, at the first and at the last probed step, and the mean fraction of energy along
1 at norm inputs (``energy.jsonl``, ``ones_fraction``) at the last step.

The text says what the numbers support and no more: an interval that contains 0 (1 for a ratio) reads
"not distinguishable at n seeds"; one seed gives the difference and says no interval is possible. A run
without a partner is listed as unpaired, never dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from corpus.atomic import atomic_write_text  # noqa: E402
from models.norms import contrasts  # noqa: E402
from normgeo.figures.style import arm_color, norm_label, save_figure  # noqa: E402
from normgeo.figures.sweep import SUMMARY_FILE, Comparison  # noqa: E402
from normgeo.measure.energy import ENERGY_FILE  # noqa: E402
from normgeo.measure.records import NULL_FILE, read_rows  # noqa: E402
from normgeo.measure.stats import mean_t_interval  # noqa: E402
from normgeo.runs.metrics import last_value  # noqa: E402

LEVEL = 0.95
SITE_CLASSES = ("ln1.in", "ln2.in", "final.in", "ln1.out", "ln2.out", "final.out")
METRICS = ("val_loss", "tokens_per_s_ratio", *(f"ones_dev/{site}" for site in SITE_CLASSES))
METRIC_TEXT = {
    "val_loss": "final validation loss",
    "tokens_per_s_ratio": "training tokens/s (ratio)",
    **{f"ones_dev/{site}": f"|angle with 1 - 90°| at {site}" for site in SITE_CLASSES},
}
VERDICT_CSV = "verdict.csv"
VERDICT_MD = "verdict.md"


@dataclass(frozen=True)
class Estimate:
    """One contrast's one metric over paired seeds."""

    arm: str
    other: str
    isolates: str
    size: str | None
    placement: str
    metric: str
    seeds: tuple[int, ...]
    values: tuple[float, ...]  # per seed: arm - other (a ratio arm / other for tokens/s)
    mean: float | None
    low: float | None
    high: float | None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def is_ratio(self) -> bool:
        return self.metric == "tokens_per_s_ratio"

    @property
    def null_value(self) -> float:
        return 1.0 if self.is_ratio else 0.0

    def distinguishable(self) -> bool | None:
        """True if the interval excludes no difference, False if it contains it, None without interval."""
        if self.low is None or self.high is None:
            return None
        return not (self.low <= self.null_value <= self.high)


def run_measures(comparison: Comparison) -> pd.DataFrame:
    """One row per run: arm keys, final validation loss, tokens/s and the angle and band measures."""
    rows = []
    for run in comparison.runs.itertuples():
        angles = comparison.angles[(comparison.angles["run"] == run.run) & (comparison.angles["ref"] == "ones")]
        last = int(angles["step"].max())
        at_last = angles[angles["step"] == last]
        summary_path = Path(run.run_dir) / SUMMARY_FILE
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        metrics = comparison.metrics[comparison.metrics["run"] == run.run]
        step_rates = metrics[metrics["metric"] == "perf/tokens_per_s"]["value"].dropna()
        row = {
            "run": run.run, "norm": run.norm, "size": run.size, "placement": run.placement, "seed": run.seed,
            "last_step": last,
            "val_loss": last_value(metrics, "val/loss"),
            "tokens_per_s": float(step_rates.median()) if len(step_rates) else summary.get("tokens_per_s"),
        }
        for site in SITE_CLASSES:
            of_site = at_last[at_last["site"] == site]["mean_deg"].dropna()
            row[f"ones_dev/{site}"] = float((of_site - 90).abs().mean()) if len(of_site) else None
        row.update(null_band_shares(Path(run.run_dir)))
        row["ones_energy_last"] = ones_energy_at_last_step(Path(run.run_dir))
        rows.append(row)
    return pd.DataFrame(rows)


def null_band_shares(run_dir: Path) -> dict[str, float | None]:
    """Share of (layer, site) records where 1 is inside the null's 5-95% band, first and last step."""
    rows = [r for r in read_rows(run_dir / NULL_FILE) if r.get("step") is not None and r.get("in_null_band") is not None]
    if not rows:
        return {"first_step": None, "in_band_first": None, "in_band_last": None}
    steps = sorted({r["step"] for r in rows})

    def share(step: int) -> float:
        at = [bool(r["in_null_band"]) for r in rows if r["step"] == step]
        return sum(at) / len(at)

    return {"first_step": steps[0], "in_band_first": share(steps[0]), "in_band_last": share(steps[-1])}


def ones_energy_at_last_step(run_dir: Path) -> float | None:
    """Mean over the norm inputs of the mean fraction of a token's energy along 1, at the last step."""
    rows = [r for r in read_rows(run_dir / ENERGY_FILE)
            if r.get("step") is not None and r.get("quantity") == "ones_fraction" and r.get("mean") is not None]
    if not rows:
        return None
    last = max(r["step"] for r in rows)
    values = [r["mean"] for r in rows if r["step"] == last]
    return sum(values) / len(values)


def paired_estimates(measures: pd.DataFrame, level: float = LEVEL) -> tuple[list[Estimate], pd.DataFrame]:
    """Every registry contrast present in ``measures``, per (size, placement); and the unpaired runs."""
    estimates: list[Estimate] = []
    paired_runs: set[str] = set()
    keys = ["size", "placement"]
    measures = measures.assign(size=measures["size"].astype(object).where(measures["size"].notna(), None))
    for (size, placement), group in measures.groupby(keys, sort=True, dropna=False):
        by_arm = {norm: rows.drop_duplicates("seed").set_index("seed") for norm, rows in group.groupby("norm")}
        for arm, other, isolates in contrasts():
            if arm not in by_arm or other not in by_arm:
                continue
            seeds = sorted(set(by_arm[arm].index) & set(by_arm[other].index))
            if not seeds:
                continue
            paired_runs.update(by_arm[arm].loc[seeds, "run"])
            paired_runs.update(by_arm[other].loc[seeds, "run"])
            for metric in METRICS:
                estimates.append(_estimate(by_arm[arm], by_arm[other], seeds, arm, other, isolates,
                                           size, placement, metric, level))
    unpaired = measures[~measures["run"].isin(paired_runs)]
    return estimates, unpaired


def _estimate(a: pd.DataFrame, b: pd.DataFrame, seeds: Sequence[int], arm: str, other: str, isolates: str,
              size, placement: str, metric: str, level: float) -> Estimate:
    column = "tokens_per_s" if metric == "tokens_per_s_ratio" else metric
    used, values = [], []
    for seed in seeds:
        x, y = a.loc[seed, column], b.loc[seed, column]
        if x is None or y is None or pd.isna(x) or pd.isna(y):
            continue  # a run that never validated / never logged throughput: the seed is left out here
        used.append(int(seed))
        values.append(math.log(x / y) if metric == "tokens_per_s_ratio" else float(x) - float(y))
    mean = low = high = None
    if values:
        mean, low, high = mean_t_interval(values, level)
    if metric == "tokens_per_s_ratio":  # back from log-ratios: geometric means
        values = [math.exp(v) for v in values]
        mean, low, high = (None if v is None else math.exp(v) for v in (mean, low, high))
    return Estimate(arm, other, isolates, size, placement, metric, tuple(used), tuple(values), mean, low, high)


# --- words ------------------------------------------------------------------------------------------------


def _number(value: float, metric: str) -> str:
    if metric == "tokens_per_s_ratio":
        return f"{value:.3f}×"
    if metric == "val_loss":
        return f"{value:+.4f}"
    return f"{value:+.2f}°"


def sentence(est: Estimate) -> str:
    """What one estimate supports, and no more."""
    what = METRIC_TEXT[est.metric]
    a, b = norm_label(est.arm), norm_label(est.other)
    if est.n == 0:
        return f"{what}: not measured in these runs."
    if est.is_ratio:
        per_seed = ", ".join(f"{v:.3f}×" for v in est.values)
        head = f"{what}: {a} / {b} = {est.mean:.3f}×"
    else:
        per_seed = ", ".join(_number(v, est.metric) for v in est.values)
        head = f"{what}: {a} − {b} = {_number(est.mean, est.metric)}"
    if est.n == 1:
        return f"{head} (seed {est.seeds[0]}); one seed: no interval is possible."
    interval = f"{_number(est.low, est.metric)} to {_number(est.high, est.metric)}"
    head += f" (95% CI {interval}; per seed {per_seed})"
    if not est.distinguishable():
        return f"{head}: not distinguishable at {est.n} seeds."
    if est.is_ratio:
        faster = a if est.mean > 1 else b
        return f"{head}: {faster} trains faster, at {est.n} seeds."
    if est.metric == "val_loss":
        better = a if est.mean < 0 else b
        return f"{head}: {better} reaches the lower validation loss, at {est.n} seeds."
    closer = b if est.mean > 0 else a
    return f"{head}: 1 is closer to orthogonal under {closer}, at {est.n} seeds."


def _group_title(est: Estimate) -> str:
    where = ", ".join(x for x in (est.size and f"size {est.size}", f"{est.placement}-norm") if x)
    return f"{norm_label(est.arm)} vs {norm_label(est.other)} ({est.isolates}; {where})"


def verdict_markdown(estimates: Sequence[Estimate], measures: pd.DataFrame, unpaired: pd.DataFrame) -> str:
    lines = ["# Verdict", ""]
    lines += [f"Paired by seed within each size and placement; differences are arm − other; 95% Student-t "
              f"intervals over seeds ({len(measures)} run{'' if len(measures) == 1 else 's'}).", ""]
    headline = [e for e in estimates if (e.arm, e.other) == ("layer", "rms")]
    if headline:
        lines += ["## The paper's question: LayerNorm vs RMSNorm", ""]
        lines += [f"- {sentence(e)}" for e in headline if e.metric in ("val_loss", "tokens_per_s_ratio", "ones_dev/ln1.in")]
        lines.append("")
    lines += ["## Every contrast", ""]
    if not estimates:
        lines.append("None: no contrast of the norm registry has runs of both its arms with a common seed.")
    title = None
    for est in estimates:
        if _group_title(est) != title:
            title = _group_title(est)
            lines += ["", f"### {title}", ""]
        lines.append(f"- {sentence(est)}")
    lines += ["", "## Per arm", "",
              "Share of (layer, site) records where 1 lies inside the null directions' 5–95% band (a typical "
              "direction), at the first and last probed step; mean fraction of energy along 1 at the norm "
              "inputs at the last step (1/d for a direction-free input).", ""]
    lines += ["| arm | size | placement | runs | val loss (mean) | 1 in null band, first step | last step | "
              "energy along 1, last step |", "|---|---|---|---|---|---|---|---|"]
    for (norm, size, placement), rows in measures.groupby(["norm", "size", "placement"], sort=True, dropna=False):
        lines.append(
            f"| {norm_label(norm)} | {size} | {placement} | {len(rows)} | {_mean(rows['val_loss'], '.4f')} | "
            f"{_mean(rows['in_band_first'], '.0%')} | {_mean(rows['in_band_last'], '.0%')} | "
            f"{_mean(rows['ones_energy_last'], '.2e')} |"
        )
    lines += ["", "## Unpaired runs", ""]
    if unpaired.empty:
        lines.append("None: every run has a partner seed in some contrast.")
    else:
        lines += [f"- {r.run} ({norm_label(r.norm)}, seed {r.seed}, size {r.size}, {r.placement}-norm): no run of "
                  "a contrasted arm with the same seed, size and placement" for r in unpaired.itertuples()]
    return "\n".join(lines) + "\n"


def _mean(values: pd.Series, spec: str) -> str:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return "-" if values.empty else format(float(values.mean()), spec)


def verdict_table(estimates: Sequence[Estimate]) -> pd.DataFrame:
    return pd.DataFrame([
        {"arm": e.arm, "other": e.other, "isolates": e.isolates, "size": e.size, "placement": e.placement,
         "metric": e.metric, "n_seeds": e.n, "seeds": " ".join(map(str, e.seeds)),
         "per_seed": " ".join(f"{v:.6g}" for v in e.values), "mean": e.mean, "ci_low": e.low, "ci_high": e.high,
         "distinguishable": e.distinguishable(), "sentence": sentence(e)}
        for e in estimates
    ])


# --- figure -----------------------------------------------------------------------------------------------


def verdict_figure(estimates: Sequence[Estimate], out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """Per metric a panel: each contrast's per-seed values (dots) and mean with its 95% interval (bar)."""
    shown = ("val_loss", "tokens_per_s_ratio", "ones_dev/ln1.in", "ones_dev/ln1.out")
    panels = [m for m in shown if any(e.metric == m and e.n for e in estimates)]
    if not panels:
        return []
    rows = list(dict.fromkeys(_row_label(e) for e in estimates))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.45 * len(rows) + 1.6),
                             sharey=True, squeeze=False, layout="constrained")
    for ax, metric in zip(axes[0], panels, strict=True):
        for est in (e for e in estimates if e.metric == metric and e.n):
            y = rows.index(_row_label(est))
            color = arm_color(est.arm, 0)
            ax.plot(est.values, [y] * est.n, "o", ms=3.5, color=color, alpha=0.5)
            if est.low is not None:
                ax.plot([est.low, est.high], [y, y], "-", lw=2.2, color=color)
            ax.plot([est.mean], [y], "D", ms=6, color=color, markeredgecolor="black", markeredgewidth=0.6)
        ax.axvline(1.0 if metric == "tokens_per_s_ratio" else 0.0, color="gray", lw=0.9, ls="--")
        ax.set_title(METRIC_TEXT[metric] + ("\narm / other" if metric == "tokens_per_s_ratio" else "\narm − other"),
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_yticks(range(len(rows)), rows, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle("Paired contrasts over seeds · dots: seeds, diamond: mean, bar: 95% t-interval")
    return save_figure(fig, out_dir, "verdict", formats)


def _row_label(est: Estimate) -> str:
    where = " ".join(x for x in (est.size, "post" if est.placement == "post" else "") if x)
    return f"{norm_label(est.arm)} vs {norm_label(est.other)}" + (f" ({where})" if where else "")


def write_verdict(comparison: Comparison, out_dir: Path, formats: Sequence[str] = ("png",)) -> list[Path]:
    """verdict.md, verdict.csv and the verdict figure for ``comparison`` into ``out_dir``."""
    measures = run_measures(comparison)
    estimates, unpaired = paired_estimates(measures)
    atomic_write_text(out_dir / VERDICT_MD, verdict_markdown(estimates, measures, unpaired))
    atomic_write_text(out_dir / VERDICT_CSV, verdict_table(estimates).to_csv(index=False))
    return [out_dir / VERDICT_MD, out_dir / VERDICT_CSV, *verdict_figure(estimates, out_dir, formats)]
