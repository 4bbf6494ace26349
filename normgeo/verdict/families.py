"""The verdict's contrasts, their tests and families.

Runs of the same size, placement and seed are paired across arms (they share the initial non-norm weights and
every batch). For each contrast of the norm registry (:func:`models.norms.contrasts`) whose two arms are both
present, every metric of :mod:`normgeo.verdict.metric_table` gives the per-seed differences, their mean and
95%/90% Student-t intervals (:func:`normgeo.measure.stats.paired_test`); the centering intervention's loss
change is taken against the intact model (``other`` = ``intact``). The families of
``conf/compare/margins.yaml``: **primary** (tested alone: t-test and TOST), **secondary** (Holm-adjusted
within these) and **described** (no test); a tested row gets its power at the observed SD. docs/compare.md
says how to read them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pandas as pd

from models.norms import contrasts
from normgeo.measure.stats import PairedTest, difference_power, holm, paired_test, tost_power
from normgeo.readers.downstream import SCORES, is_downstream, measured_at_key
from normgeo.readers.identity import RunIdentity, check_unique, design_difference
from normgeo.verdict.declared import Endpoint, VerdictConfig, load_verdict_config
from normgeo.verdict.metric_table import INTACT, INTERVENTION_METRICS, METRICS, Metric, metric

TESTED = ("primary", "secondary")
ACTION_WORDS = {"remove": "taking the mean subtraction out of", "add": "putting the mean subtraction into"}


@dataclass(frozen=True)
class Estimate:
    """One contrast's one metric over paired seeds, its tests (tested families only) and what they support."""

    arm: str
    other: str
    isolates: str
    size: str | None
    placement: str
    metric: str
    seeds: tuple[int, ...]
    values: tuple[float, ...]  # per seed: arm - other
    test: PairedTest
    family: str = "described"
    family_size: int = 0
    p_diff_holm: float | None = None
    p_tost_holm: float | None = None
    power_diff: float | None = None
    power_tost: float | None = None
    alpha: float = 0.05

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def about(self) -> Metric:
        return metric(self.metric)

    @property
    def primary(self) -> bool:
        return self.family == "primary"

    @property
    def tested(self) -> bool:
        return self.family in TESTED

    @property
    def mean(self) -> float | None:
        return self.test.mean if self.n else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        return self.test.ci95

    @property
    def ci90(self) -> tuple[float, float] | None:
        return self.test.ci90

    @property
    def low(self) -> float | None:
        return self.ci95[0] if self.ci95 else None

    @property
    def high(self) -> float | None:
        return self.ci95[1] if self.ci95 else None

    @property
    def margin(self) -> float:
        return self.test.margin

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.values) if self.n >= 2 else None

    def endpoint(self) -> Endpoint:
        return Endpoint(self.arm, self.other, self.metric)

    def outcome(self) -> str:
        """equivalent | different | inconclusive (tested families) | described | no test (below two seeds)."""
        if self.n < 2:
            return "no test"
        if not self.tested:
            return "described"
        if self.p_tost_holm < self.alpha:
            return "equivalent"
        if self.p_diff_holm < self.alpha:
            return "different"
        return "inconclusive"


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


def _sized(measures: pd.DataFrame) -> pd.DataFrame:
    """``size`` with a missing value as None (groupby keeps it as a key)."""
    return measures.assign(size=measures["size"].astype(object).where(measures["size"].notna(), None))


def measured_identity(row: dict) -> RunIdentity:
    """The identity of a run's row of measures (the keys :func:`normgeo.readers.identity.run_identity`
    reads)."""
    seed = row.get("seed")
    return RunIdentity(norm=row["norm"], placement=row.get("placement") or "pre", size=row.get("size"),
                       seed=None if seed is None or pd.isna(seed) else int(seed))


def pairings(measures: pd.DataFrame) -> tuple[list[Pairing], pd.DataFrame]:
    """Every registry contrast present in ``measures`` per (size, placement), and the unpaired runs."""
    found: list[Pairing] = []
    paired_runs: set[str] = set()
    measures = _sized(measures)
    # One run per arm and seed, by the readers' one rule: duplicates raise DuplicateRuns naming each folder.
    check_unique(
        (row.get("run_dir") or row["run"], measured_identity(row)) for row in measures.to_dict("records")
    )
    apart: dict[str, str] = {}  # a run -> why its seed's partner is not its pair (a setting besides the arm)
    for (size, placement), group in measures.groupby(["size", "placement"], sort=True, dropna=False):
        by_arm = {norm: rows.set_index("seed") for norm, rows in group.groupby("norm")}
        for arm, other, isolates in contrasts():
            if arm not in by_arm or other not in by_arm:
                continue
            seeds = []
            for seed in sorted(set(by_arm[arm].index) & set(by_arm[other].index)):
                runs = by_arm[arm].loc[seed], by_arm[other].loc[seed]
                if differs := design_difference(runs[0].get("run_dir"), runs[1].get("run_dir")):
                    key, value, other_value = differs
                    for (run, partner), (mine, theirs) in (((runs[0], runs[1]), (value, other_value)),
                                                           ((runs[1], runs[0]), (other_value, value))):
                        apart.setdefault(run["run"], f"differs from {partner['run']} in {key}: {mine!r} vs "
                                                     f"{theirs!r}")
                else:
                    seeds.append(seed)
            if not seeds:
                continue
            arm_runs, other_runs = list(by_arm[arm].loc[seeds, "run"]), list(by_arm[other].loc[seeds, "run"])
            paired_runs.update(arm_runs + other_runs)
            found.append(
                Pairing(arm, other, isolates, size, placement, [int(s) for s in seeds], arm_runs, other_runs)
            )
    unpaired = measures[~measures["run"].isin(paired_runs)]
    why = "no run of a contrasted arm with the same seed, size and placement"
    return found, unpaired.assign(why=[apart.get(run, why) for run in unpaired["run"]])


SCORE_PAIRED_FIRST = SCORES[0]  # the score whose pairing downstream_mismatches reports for its task


def measured_apart(by_run: pd.DataFrame, arm_run: str, other_run: str, name: str) -> tuple[str, str] | None:
    """What the two runs' scores of a downstream metric were measured at, when it differs; else None."""
    key = measured_at_key(name)
    pair = (by_run.loc[arm_run].get(key), by_run.loc[other_run].get(key))
    return (str(pair[0]), str(pair[1])) if pair[0] != pair[1] else None


def downstream_mismatches(measures: pd.DataFrame) -> list[str]:
    """One line per seed pair whose downstream scores were measured at different steps or example limits (and
    so are left out of the pairing), saying how to make them comparable."""
    found, _ = pairings(measures)
    by_run = measures.set_index("run")
    lines = []
    for pairing in found:
        for task_metric in downstream_metrics(measures):
            if not task_metric.endswith(f"/{SCORE_PAIRED_FIRST}"):
                continue  # one line per task, not per score
            for seed, arm_run, other_run in zip(
                pairing.seeds, pairing.arm_runs, pairing.other_runs, strict=True
            ):
                apart = measured_apart(by_run, arm_run, other_run, task_metric)
                if apart and not pd.isna(by_run.loc[arm_run].get(task_metric, float("nan"))) and not pd.isna(
                        by_run.loc[other_run].get(task_metric, float("nan"))):
                    task = task_metric.split("/")[1]
                    lines.append(
                        f"{task}, seed {seed}: {arm_run} was evaluated at {apart[0]}, {other_run} at "
                        f"{apart[1]}; not paired (evaluate both with the same --step and --limit)"
                    )
    return lines


def downstream_metrics(measures: pd.DataFrame) -> list[str]:
    """The ``downstream/<task>/<score>`` columns some run has: contrasted like ``val_loss``."""
    return sorted(c for c in measures.columns if is_downstream(c))


def contrast_estimate(by_run: pd.DataFrame, pairing: Pairing, name: str, config: VerdictConfig) -> Estimate:
    """One metric of one pairing: the per-seed differences arm − other (a seed where either run lacks the
    metric is left out of it)."""
    used, values = [], []
    for seed, arm_run, other_run in zip(pairing.seeds, pairing.arm_runs, pairing.other_runs, strict=True):
        x, y = by_run.loc[arm_run].get(name), by_run.loc[other_run].get(name)
        if x is None or y is None or pd.isna(x) or pd.isna(y):
            continue  # a run that never validated / never logged it: the seed is left out of this metric
        if is_downstream(name) and measured_apart(by_run, arm_run, other_run, name):
            # scores at another step or example limit: not comparable (downstream_mismatches says so)
            continue
        used.append(seed)
        values.append(float(x) - float(y))
    return Estimate(pairing.arm, pairing.other, pairing.isolates, pairing.size, pairing.placement, name,
                    tuple(used), tuple(values), paired_test(values, config.margin(name), config.alpha),
                    alpha=config.alpha)


def intervention_estimates(measures: pd.DataFrame, config: VerdictConfig) -> list[Estimate]:
    """Per arm (and size, placement): the centering intervention's loss change over seeds against 0: is taking
    the mean subtraction out of LayerNorm (putting it into RMSNorm) free within ±margin?"""
    estimates: list[Estimate] = []
    if "intervention_action" not in measures:
        return estimates  # measures built by hand without the intervention
    for (norm, size, placement), rows in _sized(measures).groupby(["norm", "size", "placement"], sort=True,
                                                                  dropna=False):
        actions = rows["intervention_action"].dropna()
        if actions.empty:
            continue  # DyT, or runs probed without the intervention
        isolates = f"{ACTION_WORDS.get(actions.iloc[0], actions.iloc[0])} every norm of the trained model"
        for name in INTERVENTION_METRICS:
            kept = rows.dropna(subset=[name]).sort_values("seed")
            values = [float(v) for v in kept[name]]
            test = paired_test(values, config.margin(name), config.alpha)
            seeds = tuple(int(s) for s in kept["seed"])
            estimates.append(Estimate(norm, INTACT, isolates, size, placement, name, seeds, tuple(values),
                                      test, alpha=config.alpha))
    return estimates


def paired_estimates(measures: pd.DataFrame, config: VerdictConfig | None = None
                     ) -> tuple[list[Estimate], pd.DataFrame]:
    """Every contrast x metric and every arm's intervention, in its family (primary, secondary or described),
    Holm-adjusted and powered within the tested families; and the unpaired runs."""
    config = config or load_verdict_config()
    found, unpaired = pairings(measures)
    by_run = measures.set_index("run")
    names = (*METRICS, *downstream_metrics(measures))
    estimates = [contrast_estimate(by_run, pairing, name, config) for pairing in found for name in names]
    estimates += intervention_estimates(measures, config)
    families = {config.primary: "primary", **{e: "secondary" for e in config.secondary}}
    estimates = [replace(e, family=families.get(e.endpoint(), "described")) for e in estimates]
    return adjust_families(estimates, config), unpaired


def adjust_families(estimates: Sequence[Estimate], config: VerdictConfig) -> list[Estimate]:
    """Holm within each tested family (for the difference test and for TOST), and each tested row's power at
    its observed SD and Holm's first-step level."""
    adjusted = list(estimates)
    for family in TESTED:
        members = [i for i, e in enumerate(adjusted) if e.family == family]
        p_diff = holm([adjusted[i].test.p_diff for i in members])
        p_tost = holm([adjusted[i].test.p_tost for i in members])
        size = sum(p is not None for p in p_diff)
        for i, d, t in zip(members, p_diff, p_tost, strict=True):
            est = adjusted[i]
            level = config.alpha / max(size, 1)
            sd = est.sd
            powered = sd is not None and sd > 0 and math.isfinite(sd)
            adjusted[i] = replace(
                est, p_diff_holm=d, p_tost_holm=t, family_size=size, alpha=config.alpha,
                power_diff=difference_power(est.n, sd, est.margin, level) if powered else None,
                power_tost=tost_power(est.n, sd, est.margin, 0.0, level) if powered else None)
    return adjusted
