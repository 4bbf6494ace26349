"""The verdict of a sweep: paired contrasts of the norm arms over seeds, tested for difference and for
equivalence within declared margins, with the family each test belongs to.

Runs of the same size, placement and seed are paired across arms: they share the initial non-norm
weights and every batch, so the per-seed difference removes most of the seed's own noise. For each
contrast of the norm registry (:func:`models.norms.contrasts`: ``layer`` vs ``rms``, ``layer_nobias`` vs
``rms``, ``layer`` vs ``rms_bias``, ``layer`` vs ``layer_nobias``, every arm vs ``dyt``) whose two arms are
both present, per (size, placement), the verdict takes the per-seed differences (arm minus other) of:

- ``val_loss/tail``: the mean of the last 20% of the run's validation points (at least one): the
  **primary statistic**, a stretch of the validation curve rather than its last, noisiest point;
- ``val_loss``: the final validation loss;
- ``tokens_per_s_ratio``: training tokens/s as a ratio arm / other (tests and intervals on the log-ratio,
  reported exponentiated: a geometric mean). A run's tokens/s is the median over its optimizer steps of the
  logged per-step throughput (``perf/tokens_per_s``; ``summary.json``'s wall-clock mean is the fallback);
- ``ones_dev/<site>``: per site class (``ln1.in``, ``ln2.in``, ``final.in`` and their ``.out``), the mean
  over layers of |angle with 1 - 90 degrees| at the last probed step;
- ``rank_pct``, ``band_margin``, ``ones_energy`` (each ``/last`` and ``/window``): 1's rank percentile among
  the random null directions (``null.jsonl`` ``mean_rank_pct``), that rank's distance to the nearer edge of
  the 5-95% band (min(rank - 5, 95 - rank), percentile points, negative outside), and the fraction of a
  token's energy along 1 at the norm inputs (``energy.jsonl`` ``ones_fraction``). The run is the unit:
  within a run the records are pooled first, as the mean over layers and site classes at a probe step;
  ``/last`` is that at the last probe, ``/window`` its mean over the last 30% of the run's probe steps.

Per contrast and metric: the mean difference, its 95% and 90% Student-t intervals, the two-sided paired
t-test against a zero difference and the two one-sided tests (TOST) of equivalence within ±margin
(:func:`normgeo.measure.stats.paired_test`; margins per metric kind from ``conf/compare/margins.yaml``).
The **primary question** declared in that file (``layer`` vs ``rms``, ``val_loss/tail``) is its own family;
every other row is in the exploratory family; both families' p-values are Holm-adjusted (raw and adjusted
in ``verdict.csv``) and the words use the adjusted ones:

- "equivalent within ±margin": TOST's adjusted p < alpha (the 90% interval inside ±margin);
- "different": the difference test's adjusted p < alpha;
- "inconclusive at n seeds": neither (the 90% interval is wider than the margin, or reaches past it).

- ``intervention_dloss`` (``/last`` and ``/window``): the loss change of the centering intervention, every norm
  at once (``intervention.jsonl``): LayerNorm without its mean subtraction, RMSNorm with it;
- ``downstream/<task>/<score>``: where runs have an ``eval.json`` (``python -m normgeo.evaluate``), each
  lm-evaluation-harness task's ``acc`` and ``acc_norm`` (higher is better; normgeo.runs.downstream).

Per arm, the centering intervention is also tested on its own (the **intervention family**: is taking the
mean subtraction out of LayerNorm, or putting it into RMSNorm, free within ±margin?): the run's loss change
over seeds against 0, with the same tests, Holm-adjusted within that family.

One seed gives the difference and says no test is possible. Per arm the page describes the geometry with
95% intervals over seeds, and keeps the share of (layer, site) records with 1 inside the band only as a
description (the records of one run move together: they are not independent observations). A run without a
partner is listed as unpaired, never dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from corpus.atomic import atomic_write_text  # noqa: E402
from models.norms import contrasts  # noqa: E402
from normgeo.figures.style import arm_color, norm_label, save_figure  # noqa: E402
from normgeo.figures.sweep import SUMMARY_FILE, Comparison  # noqa: E402
from normgeo.measure.energy import ENERGY_FILE  # noqa: E402
from normgeo.measure.intervention import INTERVENTION_FILE  # noqa: E402
from normgeo.measure.records import NULL_FILE, read_rows  # noqa: E402
from normgeo.measure.stats import PairedTest, holm, mean_t_interval, paired_test  # noqa: E402
from normgeo.runs.config import CONF_ROOT  # noqa: E402
from normgeo.runs.downstream import DOWNSTREAM_PREFIX, downstream_scores, is_downstream  # noqa: E402
from normgeo.runs.metrics import last_value  # noqa: E402

MARGINS_FILE = CONF_ROOT / "compare" / "margins.yaml"
SITE_CLASSES = ("ln1.in", "ln2.in", "final.in", "ln1.out", "ln2.out", "final.out")
GEOMETRY = ("rank_pct", "band_margin", "ones_energy")
INTERVENTION = "intervention_dloss"  # the centering intervention's loss change, all norms at once
INTERVENTION_METRICS = (f"{INTERVENTION}/window", f"{INTERVENTION}/last")
INTACT = "intact"  # the "other" of a per-arm intervention row: the arm's own model without the swap
METRICS = ("val_loss/tail", "val_loss", "tokens_per_s_ratio", *(f"ones_dev/{site}" for site in SITE_CLASSES),
           *(f"{kind}/{at}" for kind in GEOMETRY for at in ("window", "last")), *INTERVENTION_METRICS)
# Metric kinds with a margin: those of METRICS, and the downstream scores (their tasks known only from the runs).
MARGIN_KINDS = (*dict.fromkeys(m.split("/")[0] for m in METRICS), DOWNSTREAM_PREFIX.rstrip("/"))
VAL_TAIL = 0.2     # the primary statistic: the mean of the last 20% of the validation points
PROBE_WINDOW = 0.3  # the geometry's window: the last 30% of the probe steps
BAND = (5.0, 95.0)  # the null band's edges in rank percentile (null.jsonl's p05 and p95)
METRIC_TEXT = {
    "val_loss/tail": "validation loss, mean of the last 20% of the curve",
    "val_loss": "final validation loss",
    "tokens_per_s_ratio": "training tokens/s (ratio)",
    **{f"ones_dev/{site}": f"|angle with 1 - 90°| at {site}" for site in SITE_CLASSES},
    "rank_pct/window": "1's rank among random directions (last 30% of probes)",
    "rank_pct/last": "1's rank among random directions (last probe)",
    "band_margin/window": "1's distance inside the 5–95% band (last 30% of probes)",
    "band_margin/last": "1's distance inside the 5–95% band (last probe)",
    "ones_energy/window": "energy along 1 at the norm inputs (last 30% of probes)",
    "ones_energy/last": "energy along 1 at the norm inputs (last probe)",
    f"{INTERVENTION}/window": "Δ loss of the centering intervention, all norms (last 30% of probes)",
    f"{INTERVENTION}/last": "Δ loss of the centering intervention, all norms (last probe)",
}
ACTION_WORDS = {"remove": "taking the mean subtraction out of", "add": "putting the mean subtraction into"}
VERDICT_CSV = "verdict.csv"
VERDICT_MD = "verdict.md"
CURVE_FIGURE = "val_curve_diff"


def metric_kind(metric: str) -> str:
    """The margin key of a metric: the part before "/" (``val_loss/tail`` -> ``val_loss``)."""
    return metric.split("/")[0]


# --- the declared margins -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerdictConfig:
    """Margins per metric kind, the primary question (arm, other, metric) and each test's level."""

    margins: dict[str, float]
    primary: tuple[str, str, str] = ("layer", "rms", "val_loss/tail")
    alpha: float = 0.05

    def margin(self, metric: str) -> float:
        return self.margins[metric_kind(metric)]


def load_verdict_config(path: Path | None = None, overrides: Sequence[str] = ()) -> VerdictConfig:
    """The margins file (default ``conf/compare/margins.yaml``) with ``kind=value`` overrides applied.
    Raises ValueError with one line naming the file or key and the fix."""
    path = path or MARGINS_FILE
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: cannot read the margins file ({type(err).__name__}); give a YAML file "
                         f"like {MARGINS_FILE}") from None
    kinds = set(MARGIN_KINDS)
    margins = dict(raw.get("margins") or {})
    for item in overrides:
        key, sep, value = item.partition("=")
        margins[key.strip()] = value if sep else None
        if not sep:
            raise ValueError(f"--margin {item}: write KIND=VALUE, e.g. --margin val_loss=0.01")
    unknown = sorted(set(margins) - kinds)
    if unknown:
        raise ValueError(f"margin {unknown[0]}: unknown metric kind (one of {', '.join(sorted(kinds))})")
    missing = sorted(kinds - set(margins))
    if missing:
        raise ValueError(f"{path}: no margin for {missing[0]}; add it under margins:")
    checked = {}
    for key, value in margins.items():
        try:
            checked[key] = float(value)
        except (TypeError, ValueError):
            checked[key] = math.nan
        if not checked[key] > 0 or math.isinf(checked[key]):
            raise ValueError(f"margin {key}={value}: a margin is a positive number, e.g. {key}=0.01")
    primary = raw.get("primary") or {}
    primary_key = (primary.get("arm", "layer"), primary.get("other", "rms"), primary.get("metric", "val_loss/tail"))
    if primary_key[2] not in METRICS:
        raise ValueError(f"{path}: primary.metric={primary_key[2]} is not a verdict metric (one of {', '.join(METRICS)})")
    alpha = float(raw.get("alpha", 0.05))
    if not 0 < alpha < 0.5:
        raise ValueError(f"{path}: alpha={alpha}: a level between 0 and 0.5, e.g. 0.05")
    return VerdictConfig(checked, primary_key, alpha)


# --- per run ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """One contrast's one metric over paired seeds, its tests and what they support."""

    arm: str
    other: str
    isolates: str
    size: str | None
    placement: str
    metric: str
    seeds: tuple[int, ...]
    values: tuple[float, ...]  # per seed: arm - other (a ratio arm / other for tokens/s)
    test: PairedTest  # on the log-ratio for tokens/s
    primary: bool = False
    family: str = "exploratory"
    family_size: int = 0
    p_diff_holm: float | None = None
    p_tost_holm: float | None = None
    alpha: float = 0.05

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def is_ratio(self) -> bool:
        return self.metric == "tokens_per_s_ratio"

    def shown(self, value: float | None) -> float | None:
        """A value of the test's scale as reported (a ratio for tokens/s)."""
        return None if value is None else math.exp(value) if self.is_ratio else value

    @property
    def mean(self) -> float | None:
        return self.shown(self.test.mean) if self.n else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        return None if self.test.ci95 is None else (self.shown(self.test.ci95[0]), self.shown(self.test.ci95[1]))

    @property
    def ci90(self) -> tuple[float, float] | None:
        return None if self.test.ci90 is None else (self.shown(self.test.ci90[0]), self.shown(self.test.ci90[1]))

    @property
    def low(self) -> float | None:
        return self.ci95[0] if self.ci95 else None

    @property
    def high(self) -> float | None:
        return self.ci95[1] if self.ci95 else None

    @property
    def margin(self) -> float:
        """The margin as reported: relative (0.05 = 5%) for tokens/s, in the metric's unit otherwise."""
        return math.expm1(self.test.margin) if self.is_ratio else self.test.margin

    def outcome(self) -> str:
        """equivalent | different | inconclusive | no test (fewer than two seeds), from adjusted p-values."""
        if self.p_tost_holm is None or self.p_diff_holm is None:
            return "no test"
        if self.p_tost_holm < self.alpha:
            return "equivalent"
        if self.p_diff_holm < self.alpha:
            return "different"
        return "inconclusive"


def tail_mean(values: pd.Series, share: float) -> float | None:
    """The mean of the last ``share`` of a step-sorted series (at least its last point)."""
    if values.empty:
        return None
    count = max(1, math.ceil(share * len(values) - 1e-9))
    return float(values.iloc[-count:].mean())


def geometry_measures(run_dir: Path) -> dict[str, float | None]:
    """A run's pooled geometry: per probe step the mean over layers and site classes of 1's rank percentile,
    of its distance to the nearer band edge, and of the energy fraction along 1 at the norm inputs; at the
    last probe and over the last 30% of probe steps. Also the in-band share at the first and last step."""
    null = pd.DataFrame([r for r in read_rows(run_dir / NULL_FILE) if r.get("step") is not None])
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
    energy = [r for r in read_rows(run_dir / ENERGY_FILE)
              if r.get("step") is not None and r.get("quantity") == "ones_fraction" and r.get("mean") is not None]
    if energy:
        per_step["ones_energy"] = pd.DataFrame(energy).groupby("step")["mean"].mean().sort_index()
    for kind, series in per_step.items():
        out[f"{kind}/last"] = float(series.iloc[-1])
        out[f"{kind}/window"] = tail_mean(series, PROBE_WINDOW)
    return out


def intervention_measures(run_dir: Path) -> dict[str, float | str | None]:
    """A run's centering intervention, every norm at once: its loss change at the last probe and over the
    last 30% of probe steps, and what was done (remove: LayerNorm; add: RMSNorm)."""
    rows = sorted((r for r in read_rows(run_dir / INTERVENTION_FILE)
                   if r.get("scope") == "all" and r.get("step") is not None and r.get("delta_loss") is not None),
                  key=lambda r: r["step"])
    out: dict[str, float | str | None] = {metric: None for metric in INTERVENTION_METRICS}
    out["intervention_action"] = rows[-1]["action"] if rows else None
    if rows:
        series = pd.Series([r["delta_loss"] for r in rows], index=[r["step"] for r in rows])
        out[f"{INTERVENTION}/last"] = float(series.iloc[-1])
        out[f"{INTERVENTION}/window"] = tail_mean(series, PROBE_WINDOW)
    return out


def validation_curve(metrics: pd.DataFrame) -> pd.Series:
    """A run's validation loss by step (the last value logged at a step)."""
    val = metrics[metrics["metric"] == "val/loss"].dropna(subset=["value"]).sort_values("step")
    return val.groupby("step")["value"].last().sort_index()


def run_measures(comparison: Comparison) -> pd.DataFrame:
    """One row per run: arm keys, validation loss (final and tail), tokens/s and the geometry measures."""
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
            "val_loss/tail": tail_mean(validation_curve(metrics), VAL_TAIL),
            "tokens_per_s": float(step_rates.median()) if len(step_rates) else summary.get("tokens_per_s"),
        }
        for site in SITE_CLASSES:
            of_site = at_last[at_last["site"] == site]["mean_deg"].dropna()
            row[f"ones_dev/{site}"] = float((of_site - 90).abs().mean()) if len(of_site) else None
        row.update(geometry_measures(Path(run.run_dir)))
        row.update(intervention_measures(Path(run.run_dir)))
        row.update(downstream_scores(Path(run.run_dir)))  # downstream evaluation: see downstream_metrics
        rows.append(row)
    return pd.DataFrame(rows)


# --- contrasts and families -----------------------------------------------------------------------------------


@dataclass
class Pairing:
    """The runs of one contrast in one (size, placement), by common seed."""

    arm: str
    other: str
    isolates: str
    size: str | None
    placement: str
    seeds: list[int]
    arm_runs: list[str] = field(default_factory=list)
    other_runs: list[str] = field(default_factory=list)


def pairings(measures: pd.DataFrame) -> tuple[list[Pairing], pd.DataFrame]:
    """Every registry contrast present in ``measures`` per (size, placement), and the unpaired runs."""
    found: list[Pairing] = []
    paired_runs: set[str] = set()
    measures = measures.assign(size=measures["size"].astype(object).where(measures["size"].notna(), None))
    for (size, placement), group in measures.groupby(["size", "placement"], sort=True, dropna=False):
        by_arm = {norm: rows.drop_duplicates("seed").set_index("seed") for norm, rows in group.groupby("norm")}
        for arm, other, isolates in contrasts():
            if arm not in by_arm or other not in by_arm:
                continue
            seeds = sorted(set(by_arm[arm].index) & set(by_arm[other].index))
            if not seeds:
                continue
            arm_runs, other_runs = list(by_arm[arm].loc[seeds, "run"]), list(by_arm[other].loc[seeds, "run"])
            paired_runs.update(arm_runs + other_runs)
            found.append(Pairing(arm, other, isolates, size, placement, [int(s) for s in seeds], arm_runs, other_runs))
    return found, measures[~measures["run"].isin(paired_runs)]


def paired_estimates(measures: pd.DataFrame, config: VerdictConfig | None = None
                     ) -> tuple[list[Estimate], pd.DataFrame]:
    """Every contrast x metric with its tests, flagged primary or exploratory and Holm-adjusted within its
    family; and the unpaired runs."""
    config = config or load_verdict_config()
    found, unpaired = pairings(measures)
    by_run = measures.set_index("run")
    metrics = (*METRICS, *downstream_metrics(measures))
    estimates = [_estimate(by_run, pairing, metric, config) for pairing in found for metric in metrics]
    return adjust_families(estimates + intervention_estimates(measures, config), config), unpaired


def intervention_estimates(measures: pd.DataFrame, config: VerdictConfig) -> list[Estimate]:
    """Per arm (and size, placement): the centering intervention's loss change over seeds against 0, within
    ±margin: is taking the mean subtraction out of LayerNorm (putting it into RMSNorm) free? The
    intervention family."""
    estimates = []
    if "intervention_action" not in measures:
        return estimates  # measures of runs read by an older verdict, or built by hand
    measures = measures.assign(size=measures["size"].astype(object).where(measures["size"].notna(), None))
    for (norm, size, placement), rows in measures.groupby(["norm", "size", "placement"], sort=True, dropna=False):
        actions = rows["intervention_action"].dropna()
        if actions.empty:
            continue  # DyT, or runs probed without the intervention
        isolates = f"{ACTION_WORDS.get(actions.iloc[0], actions.iloc[0])} every norm of the trained model"
        for metric in INTERVENTION_METRICS:
            kept = rows.dropna(subset=[metric]).sort_values("seed")
            values = [float(v) for v in kept[metric]]
            estimates.append(Estimate(norm, INTACT, isolates, size, placement, metric,
                                      tuple(int(s) for s in kept["seed"]), tuple(values),
                                      paired_test(values, config.margin(metric), config.alpha),
                                      family="intervention", alpha=config.alpha))
    return estimates


def _estimate(by_run: pd.DataFrame, pairing: Pairing, metric: str, config: VerdictConfig) -> Estimate:
    column = "tokens_per_s" if metric == "tokens_per_s_ratio" else metric
    used, values = [], []
    for seed, arm_run, other_run in zip(pairing.seeds, pairing.arm_runs, pairing.other_runs, strict=True):
        x, y = by_run.loc[arm_run, column], by_run.loc[other_run, column]
        if x is None or y is None or pd.isna(x) or pd.isna(y):
            continue  # a run that never validated / never logged it: the seed is left out of this metric
        used.append(seed)
        values.append(math.log(x / y) if metric == "tokens_per_s_ratio" else float(x) - float(y))
    ratio = metric == "tokens_per_s_ratio"
    margin = math.log1p(config.margin(metric)) if ratio else config.margin(metric)
    test = paired_test(values, margin, config.alpha)
    shown = tuple(math.exp(v) for v in values) if ratio else tuple(values)
    primary = (pairing.arm, pairing.other, metric) == config.primary
    return Estimate(pairing.arm, pairing.other, pairing.isolates, pairing.size, pairing.placement, metric,
                    tuple(used), shown, test, primary=primary, family="primary" if primary else "exploratory",
                    alpha=config.alpha)


def adjust_families(estimates: Sequence[Estimate], config: VerdictConfig) -> list[Estimate]:
    """Holm within each family (the primary rows; every other row), for the difference test and for TOST."""
    adjusted = list(estimates)
    for family in ("primary", "exploratory", "intervention"):
        members = [i for i, e in enumerate(adjusted) if e.family == family]
        p_diff = holm([adjusted[i].test.p_diff for i in members])
        p_tost = holm([adjusted[i].test.p_tost for i in members])
        size = sum(p is not None for p in p_diff)
        for i, d, t in zip(members, p_diff, p_tost, strict=True):
            adjusted[i] = replace(adjusted[i], p_diff_holm=d, p_tost_holm=t, family_size=size, alpha=config.alpha)
    return adjusted


# --- words ------------------------------------------------------------------------------------------------


def metric_text(metric: str) -> str:
    if is_downstream(metric):
        task, score = metric.split("/")[1:3]
        return f"{task} {score} (lm-evaluation-harness)"
    return METRIC_TEXT[metric]


def downstream_metrics(measures: pd.DataFrame) -> list[str]:
    """The ``downstream/<task>/<score>`` columns some run has: contrasted like ``val_loss``."""
    return sorted(c for c in measures.columns if is_downstream(c))


def _number(value: float, metric: str) -> str:
    kind = metric_kind(metric)
    if kind in ("downstream", INTERVENTION):
        return f"{value:+.4f}"
    if kind == "tokens_per_s_ratio":
        return f"{value:.3f}×"
    if kind == "val_loss":
        return f"{value:+.4f}"
    if kind == "ones_dev":
        return f"{value:+.2f}°"
    if kind == "ones_energy":
        return f"{value:+.4f}"
    return f"{value:+.1f}"  # percentile points


def margin_text(est: Estimate) -> str:
    kind = metric_kind(est.metric)
    if kind == "tokens_per_s_ratio":
        return f"±{est.margin:.0%}"
    unit = {"val_loss": " nats", "ones_dev": "°", "rank_pct": " percentile points",
            "band_margin": " percentile points", INTERVENTION: " nats", "downstream": " (accuracy)"}.get(kind, "")
    return f"±{est.margin:g}{unit}"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}" if value >= 0.001 else "<0.001"


def _direction(est: Estimate) -> str:
    a, b = norm_label(est.arm), norm_label(est.other)
    kind = metric_kind(est.metric)
    if kind == "tokens_per_s_ratio":
        return f"{a if est.mean > 1 else b} trains faster"
    if kind == "val_loss":
        return f"{a if est.mean < 0 else b} reaches the lower validation loss"
    if kind == "ones_dev":
        return f"1 is closer to orthogonal under {b if est.mean > 0 else a}"
    if kind == "rank_pct":
        return f"1 ranks higher among the random directions under {a if est.mean > 0 else b}"
    if kind == "band_margin":
        return f"1 sits deeper inside the band of random directions under {a if est.mean > 0 else b}"
    if kind == "downstream":
        return f"{a if est.mean > 0 else b} scores higher"
    if kind == INTERVENTION and est.other == INTACT:
        return f"{est.isolates} {'raises' if est.mean > 0 else 'lowers'} the loss"
    if kind == INTERVENTION:
        return f"the intervention changes {a if est.mean > 0 else b}'s loss more"
    return f"more of the energy lies along 1 under {a if est.mean > 0 else b}"


def family_tag(est: Estimate) -> str:
    """Which family a row's adjusted p-values are of, and its size."""
    if est.primary and est.family_size == 1:
        return "the primary question, tested alone"
    return f"Holm-adjusted in the {est.family} family of {est.family_size} tests"


def sentence(est: Estimate) -> str:
    """What one estimate supports, and no more: the words follow the adjusted p-values."""
    what = metric_text(est.metric)
    a, b = norm_label(est.arm), norm_label(est.other)
    if est.n == 0:
        return f"{what}: not measured in these runs."
    op = "/" if est.is_ratio else "−"
    per_seed = ", ".join(_number(v, est.metric) for v in est.values)
    if est.other == INTACT:  # one arm's intervention against its intact model
        head = f"{what}, {a} ({est.isolates}): {_number(est.mean, est.metric)}"
    else:
        head = f"{what}: {a} {op} {b} = {_number(est.mean, est.metric)}"
    if est.n == 1:
        return f"{head} (seed {est.seeds[0]}); one seed: no interval and no test are possible."
    (l95, h95), (l90, h90) = est.ci95, est.ci90
    n = est.metric
    head += (f" (95% CI {_number(l95, n)} to {_number(h95, n)}; 90% CI {_number(l90, n)} to {_number(h90, n)}; "
             f"per seed {per_seed}; {family_tag(est)}: p = {_p(est.p_diff_holm)} for a difference, "
             f"{_p(est.p_tost_holm)} for equivalence within {margin_text(est)})")
    outcome = est.outcome()
    if outcome == "equivalent":
        also = f"; a difference smaller than the margin is resolved: {_direction(est)}" \
            if est.p_diff_holm is not None and est.p_diff_holm < est.alpha else ""
        if est.other == INTACT:
            return f"{head}: free within {margin_text(est)} (equivalent to the intact model), at {est.n} seeds{also}."
        return f"{head}: equivalent within {margin_text(est)}, at {est.n} seeds{also}."
    if outcome == "different":
        return f"{head}: different: {_direction(est)}, at {est.n} seeds."
    test = est.test
    wider = test.ci90[1] - test.ci90[0] > 2 * test.margin
    why = "the 90% interval is wider than the margin" if wider else "the 90% interval reaches past the margin"
    return f"{head}: inconclusive at {est.n} seeds ({why} {margin_text(est)}; nor is a difference resolved)."


def _group_title(est: Estimate) -> str:
    where = ", ".join(x for x in (est.size and f"size {est.size}", f"{est.placement}-norm") if x)
    return f"{norm_label(est.arm)} vs {norm_label(est.other)} ({est.isolates}; {where})"


def family_text(estimates: Sequence[Estimate]) -> list[str]:
    """The families, stated: what was tested, how many tests, how they are corrected."""
    explored = [e for e in estimates if e.family == "exploratory"]
    contrasts_n = len({(e.arm, e.other, e.size, e.placement) for e in explored})
    metrics_n = len({e.metric for e in explored})
    tested = explored[0].family_size if explored else 0
    primary = [e for e in estimates if e.primary]
    lines = []
    if primary:
        p = primary[0]
        lines.append(f"**Primary question** (declared in `conf/compare/margins.yaml` before the runs): "
                     f"{norm_label(p.arm)} vs {norm_label(p.other)}, {METRIC_TEXT[p.metric]} (`{p.metric}`), "
                     f"margin {margin_text(p)}: its own family of {p.family_size} test"
                     f"{'s' if p.family_size != 1 else ''}, not corrected for the exploratory rows.")
    arms = [e for e in estimates if e.family == "intervention"]
    if arms:
        lines.append(f"**Intervention family**: per arm, the centering intervention's loss change against the "
                     f"intact model ({len({(e.arm, e.size, e.placement) for e in arms})} arm(s) × "
                     f"{len({e.metric for e in arms})} statistics, {arms[0].family_size} with at least two seeds), "
                     "Holm-adjusted within this family: is taking the mean subtraction out of LayerNorm, or putting "
                     "it into RMSNorm, free?")
    lines.append(f"**Exploratory family**: {contrasts_n} contrast(s) × {metrics_n} metrics, less the primary "
                 f"row: {len(explored)} rows, {tested} of them with at least two seeds (tested; the others give "
                 f"the difference only). Holm-adjusted over those {tested}, separately for the difference test and "
                 f"for the equivalence test (TOST).")
    return lines


def verdict_markdown(estimates: Sequence[Estimate], measures: pd.DataFrame, unpaired: pd.DataFrame) -> str:
    alpha = estimates[0].alpha if estimates else 0.05
    lines = ["# Verdict", ""]
    lines += [f"Paired by seed within each size and placement ({len(measures)} run{'' if len(measures) == 1 else 's'}); "
              f"differences are arm − other. "
              f"Each row: 95% and 90% Student-t intervals over seeds; a two-sided paired t-test against a zero difference "
              f"and two one-sided tests (TOST) of equivalence within the declared margin, each at {alpha:g}; "
              f"the words follow the Holm-adjusted p-values: \"equivalent within ±margin\" (TOST), "
              f"\"different\" (t-test), else \"inconclusive\". Raw and adjusted p-values: `verdict.csv`.", ""]
    lines += family_text(estimates) + [""]
    primary = [e for e in estimates if e.primary]
    headline = [e for e in estimates if (e.arm, e.other) == (primary[0].arm, primary[0].other)] if primary else []
    if headline:
        lines += ["## The primary question", ""]
        lines += [f"- {sentence(e)}" for e in primary]
        lines += ["", "Exploratory rows of the same contrast:", ""]
        lines += [f"- {sentence(e)}" for e in headline
                  if not e.primary and e.metric in ("val_loss", "tokens_per_s_ratio", "rank_pct/window",
                                                     "ones_energy/window")]
        lines.append("")
    changes = [e for e in estimates if e.family == "intervention"]
    if changes:
        lines += ["## The centering intervention, per arm", "",
                  "The trained model with the mean subtraction taken out of every LayerNorm (put into every RMSNorm), "
                  "its next-token loss against the intact model's on the probe text (`intervention.jsonl`, "
                  "scope `all`), per seed, then over seeds:", ""]
        lines += [f"- {sentence(e)}" for e in changes]
        lines.append("")
    estimates = [e for e in estimates if e.family != "intervention"]
    lines += ["## Every contrast", ""]
    if not estimates:
        lines.append("None: no contrast of the norm registry has runs of both its arms with a common seed.")
    title = None
    for est in estimates:
        if _group_title(est) != title:
            title = _group_title(est)
            lines += ["", f"### {title}", ""]
        lines.append(f"- {'**primary** ' if est.primary else ''}{sentence(est)}")
    lines += ["", "## Per arm", "", *per_arm_lines(measures)]
    lines += ["", "## Unpaired runs", ""]
    if unpaired.empty:
        lines.append("None: every run has a partner seed in some contrast.")
    else:
        lines += [f"- {r.run} ({norm_label(r.norm)}, seed {r.seed}, size {r.size}, {r.placement}-norm): no run of "
                  "a contrasted arm with the same seed, size and placement" for r in unpaired.itertuples()]
    return "\n".join(lines) + "\n"


def per_arm_lines(measures: pd.DataFrame) -> list[str]:
    """Per arm: the pooled geometry with 95% t-intervals over seeds (the run is the unit), and the in-band
    share as a description."""
    lines = ["The run is the unit: within a run, `null.jsonl` and `energy.jsonl` records are pooled as the mean "
             "over layers and site classes at each probe step; the window is the mean over the last 30% of "
             "the probe steps. Values are means over seeds with 95% t-intervals. Rank: 1's percentile rank "
             "among the random directions (50: the median direction; the band of typical directions is "
             "5–95); distance to the band edge: min(rank − 5, 95 − rank), negative outside the band; energy "
             "along 1 at the norm inputs (1/d for a direction-free input).", "",
             "| arm | size | placement | runs | val loss, tail (mean) | rank, window | rank, last probe | "
             "distance to band edge, window | energy along 1, window | energy along 1, last probe |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups = list(measures.groupby(["norm", "size", "placement"], sort=True, dropna=False))
    for (norm, size, placement), rows in groups:
        lines.append(
            f"| {norm_label(norm)} | {size} | {placement} | {len(rows)} | {_mean(rows['val_loss/tail'], '.4f')} | "
            f"{_interval(rows['rank_pct/window'], '.1f')} | {_interval(rows['rank_pct/last'], '.1f')} | "
            f"{_interval(rows['band_margin/window'], '.1f')} | {_interval(rows['ones_energy/window'], '.4f')} | "
            f"{_interval(rows['ones_energy/last'], '.4f')} |")
    lines += ["", "Described, not tested: the share of (layer, site) records with 1 inside the null "
              "directions' 5–95% band at the first and the last probed step. The records of one run are not "
              "independent (from the first block on, a run's sites move together) and the share cuts a "
              "continuous rank at the band edge where 1 may sit, so it can jump between adjacent probes; the "
              "rank and its distance to the edge above are what the contrasts test.", "",
              "| arm | size | placement | runs | 1 in band, first step | last step |", "|---|---|---|---|---|---|"]
    for (norm, size, placement), rows in groups:
        lines.append(f"| {norm_label(norm)} | {size} | {placement} | {len(rows)} | "
                     f"{_mean(rows['in_band_first'], '.0%')} | {_mean(rows['in_band_last'], '.0%')} |")
    return lines


def _mean(values: pd.Series, spec: str) -> str:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return "-" if values.empty else format(float(values.mean()), spec)


def _interval(values: pd.Series, spec: str) -> str:
    values = pd.to_numeric(values, errors="coerce").dropna()
    if values.empty:
        return "-"
    mean, low, high = mean_t_interval(list(values))
    return format(mean, spec) + ("" if low is None else f" ({format(low, spec)} to {format(high, spec)})")


def verdict_table(estimates: Sequence[Estimate]) -> pd.DataFrame:
    rows = []
    for e in estimates:
        ci95, ci90 = e.ci95 or (None, None), e.ci90 or (None, None)
        rows.append({
            "arm": e.arm, "other": e.other, "isolates": e.isolates, "size": e.size, "placement": e.placement,
            "metric": e.metric, "primary": e.primary, "family": e.family, "family_size": e.family_size,
            "n_seeds": e.n, "seeds": " ".join(map(str, e.seeds)), "per_seed": " ".join(f"{v:.6g}" for v in e.values),
            "mean": e.mean, "margin": e.margin, "ci95_low": ci95[0], "ci95_high": ci95[1],
            "ci90_low": ci90[0], "ci90_high": ci90[1], "p_diff": e.test.p_diff, "p_diff_holm": e.p_diff_holm,
            "p_tost": e.test.p_tost, "p_tost_holm": e.p_tost_holm, "outcome": e.outcome(), "sentence": sentence(e),
        })
    return pd.DataFrame(rows)


# --- figures ----------------------------------------------------------------------------------------------


def verdict_figure(estimates: Sequence[Estimate], out_dir: Path, formats: Sequence[str]) -> list[Path]:
    """Per metric a panel: each contrast's per-seed values (dots), mean with its 95% (thin) and 90% (thick)
    intervals, and the ±margin (grey band)."""
    shown = ("val_loss/tail", "tokens_per_s_ratio", "rank_pct/window", "ones_energy/window", f"{INTERVENTION}/window")
    panels = [m for m in shown if any(e.metric == m and e.n for e in estimates)]
    if not panels:
        return []
    rows = list(dict.fromkeys(_row_label(e) for e in estimates))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.45 * len(rows) + 1.6),
                             sharey=True, squeeze=False, layout="constrained")
    for ax, metric in zip(axes[0], panels, strict=True):
        center = 1.0 if metric == "tokens_per_s_ratio" else 0.0
        for est in (e for e in estimates if e.metric == metric and e.n):
            y = rows.index(_row_label(est))
            color = arm_color(est.arm, 0)
            ax.plot(est.values, [y] * est.n, "o", ms=3.5, color=color, alpha=0.5)
            if est.ci95 is not None:
                ax.plot(est.ci95, [y, y], "-", lw=1.0, color=color)
                ax.plot(est.ci90, [y, y], "-", lw=3.0, color=color)
            ax.plot([est.mean], [y], "D", ms=6, color=color, markeredgecolor="black", markeredgewidth=0.6)
            low, high = (1 / (1 + est.margin), 1 + est.margin) if est.is_ratio else (-est.margin, est.margin)
        ax.axvspan(low, high, color="gray", alpha=0.15, lw=0)
        ax.axvline(center, color="gray", lw=0.9, ls="--")
        ax.set_title(metric_text(metric) + ("\narm / other" if metric == "tokens_per_s_ratio" else "\narm − other"),
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_yticks(range(len(rows)), rows, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle("Paired contrasts over seeds · dots: seeds, diamond: mean, bars: 95% (thin) and 90% (thick) "
                 "t-intervals, grey: ±margin")
    return save_figure(fig, out_dir, "verdict", formats)


def _row_label(est: Estimate) -> str:
    where = " ".join(x for x in (est.size, "post" if est.placement == "post" else "") if x)
    return f"{norm_label(est.arm)} vs {norm_label(est.other)}" + (f" ({where})" if where else "")


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
            diff = (validation_curve(metrics[metrics["run"] == a]) - validation_curve(metrics[metrics["run"] == b])).dropna()
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
        ax.set_title(f"{norm_label(pairing.arm)} − {norm_label(pairing.other)}" + (f" ({where})" if where else "")
                     + f", {len(pairing.seeds)} seed{'s' if len(pairing.seeds) != 1 else ''}", fontsize=9)
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
    atomic_write_text(out_dir / VERDICT_MD, verdict_markdown(estimates, measures, unpaired))
    atomic_write_text(out_dir / VERDICT_CSV, verdict_table(estimates).to_csv(index=False))
    return [out_dir / VERDICT_MD, out_dir / VERDICT_CSV, *verdict_figure(estimates, out_dir, formats),
            *curve_figure(comparison, found, config, out_dir, formats)]
