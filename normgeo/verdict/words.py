"""The verdict in words and tables: ``verdict.md`` (one table per family; sentences only for the primary
question and the declared secondary endpoints) and ``verdict.csv`` (every row, raw and adjusted p-values).
The words follow the Holm-adjusted p-values of the tested families and say no more; a described row gets no
test words."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from models.norms import arm_label
from normgeo.measure.stats import mean_t_interval
from normgeo.verdict.declared import Endpoint, VerdictConfig
from normgeo.verdict.families import Estimate
from normgeo.verdict.metric_table import INTACT

FAMILY_TITLES = {"primary": "The primary question", "secondary": "Declared secondary questions",
                 "described": "Described, not tested"}
ONE_SEED = "one seed: no interval and no test are possible"


def p_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}" if value >= 0.001 else "<0.001"


def family_tag(est: Estimate) -> str:
    """Which family a row's adjusted p-values are of, and its size."""
    if est.primary and est.family_size == 1:
        return "the primary question, tested alone"
    return f"Holm-adjusted in the {est.family} family of {est.family_size} tests"


def power_text(est: Estimate) -> str:
    if est.power_diff is None:
        return "-"
    return f"{est.power_diff:.2f} / {est.power_tost:.2f}"


def contrast_text(est: Estimate, where: bool = False) -> str:
    """``LayerNorm − RMSNorm``, or one arm's intervention against its intact model; with ``where``, the size
    and placement."""
    a = arm_label(est.arm)
    head = f"{a}, intervention − intact" if est.other == INTACT else f"{a} − {arm_label(est.other)}"
    place = " ".join(x for x in (est.size, "post" if est.placement == "post" else "") if x)
    return f"{head} ({place})" if where and place else head


def sentence(est: Estimate) -> str:
    """What one estimate supports, and no more: the words follow the adjusted p-values of its family."""
    about = est.about
    a, b = arm_label(est.arm), arm_label(est.other)
    if est.n == 0:
        return f"{about.text}: not measured in these runs."
    if est.other == INTACT:  # one arm's intervention against its intact model
        head = f"{about.text}, {a} ({est.isolates}): {about.number(est.mean)}"
    else:
        head = f"{about.text}: {a} − {b} = {about.number(est.mean)}"
    if est.n == 1:
        return f"{head} (seed {est.seeds[0]}); {ONE_SEED}."
    (l90, h90), margin = est.ci90, about.margin_text(est.margin)
    per_seed = ", ".join(about.number(v) for v in est.values)
    head += f" (90% interval {about.number(l90)} to {about.number(h90)}; per seed {per_seed}"
    if not est.tested:
        return f"{head}; described, not tested)."
    head += (
        f"; {family_tag(est)}: p = {p_text(est.p_diff_holm)} for a difference, {p_text(est.p_tost_holm)} "
        f"for equivalence within {margin}; power at the observed SD {power_text(est)})"
    )
    outcome = est.outcome()
    if outcome == "equivalent":
        also = (f"; a difference smaller than the margin is resolved: {direction(est)}"
                if est.p_diff_holm < est.alpha else "")
        if est.other == INTACT:
            return f"{head}: free within {margin} (equivalent to the intact model), at {est.n} seeds{also}."
        return f"{head}: equivalent within {margin}, at {est.n} seeds{also}."
    if outcome == "different":
        return f"{head}: different: {direction(est)}, at {est.n} seeds."
    test = est.test
    wider = test.ci90[1] - test.ci90[0] > 2 * test.margin
    why = "the 90% interval is wider than the margin" if wider else "the 90% interval reaches past the margin"
    return f"{head}: inconclusive at {est.n} seeds ({why} {margin}; nor is a difference resolved)."


def direction(est: Estimate) -> str:
    if est.other == INTACT:
        return f"{est.isolates} {'raises' if est.mean > 0 else 'lowers'} the loss"
    return est.about.which(est.mean, arm_label(est.arm), arm_label(est.other))


def family_table(estimates: Sequence[Estimate], where: bool = False) -> list[str]:
    """One markdown table of a family: contrast, metric, seeds, mean, 90% interval, margin, Holm-adjusted p
    for a difference and for equivalence, power (tested families), outcome."""
    tested = any(e.tested for e in estimates)
    header = ["contrast", "metric", "seeds", "mean", "90% interval", "margin", "p difference (Holm)",
              "p equivalence (Holm)", *(["power: difference / equivalence"] if tested else []), "outcome"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for e in estimates:
        about = e.about
        interval = f"{about.number(e.ci90[0])} to {about.number(e.ci90[1])}" if e.ci90 else "-"
        cells = [contrast_text(e, where), f"`{e.metric}`", str(e.n), about.number(e.mean) if e.n else "-",
                 interval, about.margin_text(e.margin), p_text(e.p_diff_holm), p_text(e.p_tost_holm),
                 *([power_text(e)] if tested else []), e.outcome()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def absent_arms_line(endpoints: Sequence[Endpoint], measures: pd.DataFrame, source: str) -> str:
    """Why a declared family has no row: the declared arms that no run of the sweep has, named."""
    present = set(measures["norm"]) if "norm" in measures else set()
    absent = sorted({side for e in endpoints for side in (e.arm, e.other)} - present - {INTACT})
    if absent:
        return (f"None: no run of the declared arm(s) {', '.join(f'`{a}`' for a in absent)} in these runs "
                f"(`{source}`; train them, or declare arms the sweep has).")
    return "None: the declared contrast's arms have no common seed in these runs."


def verdict_markdown(estimates: Sequence[Estimate], measures: pd.DataFrame, unpaired: pd.DataFrame,
                     config: VerdictConfig | None = None, not_paired: Sequence[str] = ()) -> str:
    """verdict.md: per family a table (sentences for the declared questions), the arms, the unpaired runs and
    the downstream scores left unpaired (``not_paired``: measured at different steps or limits)."""
    alpha = estimates[0].alpha if estimates else 0.05
    source = (config or VerdictConfig({})).source  # the margins file these questions were declared in
    where = len({(e.size, e.placement) for e in estimates}) > 1
    lines = [
        "# Verdict",
        "",
        f"{len(measures)} run{'' if len(measures) == 1 else 's'}, paired by seed within each size and "
        "placement; differences are arm − other, with 90% Student-t intervals over seeds. Declared before "
        f"the runs (`{source}`): the primary question, tested alone, and the secondary endpoints, "
        f"Holm-adjusted within their family; each is tested at {alpha:g} for a difference (paired t-test) "
        "and for equivalence within its margin (TOST); power at the observed SD and Holm's first-step "
        "level. Every other row is described, not tested. Raw and adjusted p-values, per-seed values: "
        "`verdict.csv`.",
        "",
    ]
    if estimates and max(e.n for e in estimates) < 2:
        lines += [f"**{ONE_SEED.capitalize()}** (every contrast has one seed per arm); the tables give each "
                  "difference only.", ""]
    for family, title in FAMILY_TITLES.items():
        members = [e for e in estimates if e.family == family]
        if not members and family == "described":
            continue
        lines += [f"## {title}", ""]
        if family == "secondary":
            lines += [
                f"{len(members)} row(s) of the endpoints declared in `{source}`, "
                f"{members[0].family_size if members else 0} with at least two seeds (Holm within these "
                "only).",
                "",
            ]
        if family in ("primary", "secondary"):
            said = [f"- {sentence(e)}" for e in members if e.n >= 2]
            lines += said + ([""] if said else [])
        declared = ((config.primary,) if family == "primary" else config.secondary) if config else ()
        table = family_table(members, where) if members else [absent_arms_line(declared, measures, source)]
        lines += [*table, ""]
    lines += ["## Per arm", "", *per_arm_lines(measures), "", "## Unpaired runs", ""]
    if unpaired.empty:
        lines.append("None: every run has a partner seed in some contrast.")
    else:
        lines += [f"- {r.run} ({arm_label(r.norm)}, seed {r.seed}, size {r.size}, {r.placement}-norm): "
                  f"{r.why}" for r in unpaired.itertuples()]
    if not_paired:
        lines += ["", "## Downstream scores not paired", "", *(f"- {line}" for line in not_paired)]
    return "\n".join(lines) + "\n"


def per_arm_lines(measures: pd.DataFrame) -> list[str]:
    """Per arm: the pooled geometry with 95% t-intervals over seeds (the run is the unit), and the in-band
    share as a description."""
    lines = [
        "Means over seeds with 95% t-intervals; the run is the unit (records pooled over layers and site "
        "classes per probe step; window: the last 30% of the probe steps). Rank: 1's percentile among the "
        "random directions (the band of typical directions is 5–95); energy along 1 at the norm inputs "
        "(1/d for a direction-free input); in band: the share of (layer, site) records with 1 inside the "
        "band at the first and last probe, described only (a run's records move together).",
        "",
        "| arm | size | placement | runs | val loss, tail | rank, window | distance to band edge, window | "
        "energy along 1, window | 1 in band, first / last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_arm = measures.groupby(["norm", "size", "placement"], sort=True, dropna=False)
    for (norm, size, placement), rows in by_arm:
        lines.append(
            f"| {arm_label(norm)} | {size} | {placement} | {len(rows)} | "
            f"{_mean(rows['val_loss/tail'], '.4f')} | "
            f"{_interval(rows.get('rank_pct/window'), '.1f')} | "
            f"{_interval(rows.get('band_margin/window'), '.1f')} | "
            f"{_interval(rows.get('ones_energy/window'), '.4f')} | "
            f"{_mean(rows.get('in_band_first'), '.0%')} / "
            f"{_mean(rows.get('in_band_last'), '.0%')} |"
        )
    return lines


def _numbers(values: pd.Series | None) -> pd.Series:
    """A column's numbers (none for an absent column)."""
    return pd.to_numeric(values, errors="coerce").dropna() if values is not None else pd.Series(dtype=float)


def _mean(values: pd.Series | None, spec: str) -> str:
    values = _numbers(values)
    return "-" if values.empty else format(float(values.mean()), spec)


def _interval(values: pd.Series | None, spec: str) -> str:
    values = _numbers(values)
    if values.empty:
        return "-"
    mean, low, high = mean_t_interval(list(values))
    return format(mean, spec) + ("" if low is None else f" ({format(low, spec)} to {format(high, spec)})")


def verdict_table(estimates: Sequence[Estimate]) -> pd.DataFrame:
    """verdict.csv: every row with its family, per-seed values, intervals, raw and adjusted p (tested
    families only), power and outcome."""
    rows = []
    for e in estimates:
        ci95, ci90 = e.ci95 or (None, None), e.ci90 or (None, None)
        rows.append({
            "arm": e.arm, "other": e.other, "isolates": e.isolates, "size": e.size, "placement": e.placement,
            "metric": e.metric, "primary": e.primary, "family": e.family, "family_size": e.family_size,
            "n_seeds": e.n, "seeds": " ".join(map(str, e.seeds)),
            "per_seed": " ".join(f"{v:.6g}" for v in e.values),
            "mean": e.mean, "sd": e.sd, "margin": e.margin,
            "ci95_low": ci95[0], "ci95_high": ci95[1], "ci90_low": ci90[0], "ci90_high": ci90[1],
            "p_diff": e.test.p_diff if e.tested else None, "p_diff_holm": e.p_diff_holm,
            "p_tost": e.test.p_tost if e.tested else None, "p_tost_holm": e.p_tost_holm,
            "power_diff": e.power_diff, "power_tost": e.power_tost, "outcome": e.outcome(),
            "sentence": sentence(e),
        })
    return pd.DataFrame(rows)
