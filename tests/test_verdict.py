"""The verdict of normgeo.compare: paired contrasts over seeds with t-intervals, difference and equivalence
tests (TOST) and Holm's correction within declared families, checked against independent computations
(scipy's t distribution, Holm by hand) on per-seed values and on runs built with known differences; the
seeds a margin needs, checked against a simulation; and a toy arm defined only in a test, trained by the
real train.py, probed, compared and judged."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats
from statsmodels.stats.multitest import multipletests

from models.norms import NORM_ARMS, contrasts, unregister_arm
from normgeo.compare import main as compare_main
from normgeo.figures.sweep import load
from normgeo.figures.verdict import write_verdict
from normgeo.measure.stats import difference_power, seeds_for_difference, seeds_for_equivalence, tost_power
from normgeo.verdict.declared import MARGINS_FILE, Endpoint, load_verdict_config
from normgeo.verdict.families import paired_estimates
from normgeo.verdict.measures import geometry_measures, run_measures
from normgeo.verdict.metric_table import MARGIN_KEYS, METRICS, SITE_CLASSES, metric
from normgeo.verdict.words import ONE_SEED, sentence
from tests import toy_arm
from tests.conftest import ARM_SETTINGS, FAST, ROOT

SITES = {0: ("ln1", "ln2"), 1: ("ln1", "ln2"), "final": ("final",)}


def make_run(root: Path, norm: str, seed: int, *, val_loss: float, tokens_per_s: float, dev: float,
             in_band: tuple[bool, bool] = (True, False), energy: float = 0.01, placement: str = "pre",
             step_rates: tuple[float, ...] = (), rank: tuple[float, float] = (50.0, 50.0)) -> Path:
    """A run directory with the files the verdict reads, every |angle - 90| at the last step = ``dev``."""
    run_dir = root / f"{norm}{'-post' if placement == 'post' else ''}-s{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "run_config.yaml").write_text(yaml.safe_dump({
        "run_name": run_dir.name, "norm": {"name": norm}, "placement": {"name": placement}, "seed": seed,
        "size": {"name": "toy"}, "global_batch": 4, "seq_len": 8, "max_steps": 10}))
    angles, null, energy_rows = [], [], []
    for step, band, rank_pct in zip((0, 10), in_band, rank, strict=True):
        for layer, roles in SITES.items():
            for role in roles:
                for suffix, sign in (("in", 1), ("out", -1)):
                    deg = 90 + sign * (dev if step == 10 else 1.0)
                    angles.append(
                        {
                            "model": "m",
                            "norm": norm,
                            "step": step,
                            "layer": layer,
                            "site": f"{role}.{suffix}",
                            "ref": "ones",
                            "mean_deg": deg,
                            "p05": deg - 3,
                            "p95": deg + 3,
                        }
                    )
                    null.append(
                        {
                            "model": "m",
                            "norm": norm,
                            "step": step,
                            "layer": layer,
                            "site": f"{role}.{suffix}",
                            "in_null_band": band,
                            "mean_rank_pct": rank_pct,
                        }
                    )
                energy_rows.append(
                    {
                        "model": "m",
                        "norm": norm,
                        "step": step,
                        "layer": layer,
                        "site": f"{role}.in",
                        "quantity": "ones_fraction",
                        "mean": energy,
                    }
                )
    for name, rows in (("angles.jsonl", angles), ("null.jsonl", null), ("energy.jsonl", energy_rows)):
        (run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "csv" / "version_0").mkdir(parents=True)
    metrics = f"step,val/loss,perf/tokens_per_s\n5,{val_loss + 1},\n10,{val_loss},\n"
    metrics += "".join(f"{step},,{rate}\n" for step, rate in enumerate(step_rates, start=1))
    (run_dir / "csv" / "version_0" / "metrics.csv").write_text(metrics)
    (run_dir / "summary.json").write_text(json.dumps({"tokens_per_s": tokens_per_s}))
    return run_dir


def independent_interval(values) -> tuple[float, float, float]:
    result = stats.ttest_1samp(np.asarray(values), popmean=0.0)
    ci = result.confidence_interval(confidence_level=0.95)
    return float(np.mean(values)), float(ci.low), float(ci.high)


@pytest.fixture()
def known_sweep(tmp_path: Path) -> tuple[Path, dict]:
    """layer vs rms at 3 seeds with known per-seed differences, one rms_bias seed, an unpaired dyt run."""
    truth = {"val": [0.10, 0.14, 0.06], "speed": [0.90, 0.80, 0.85], "dev": [0.5, 1.5, 1.0]}
    for seed in range(3):
        make_run(tmp_path, "rms", seed, val_loss=5.0 + seed, tokens_per_s=1000.0 + seed, dev=2.0)
        make_run(tmp_path, "layer", seed, val_loss=5.0 + seed + truth["val"][seed],
                 tokens_per_s=(1000.0 + seed) * truth["speed"][seed], dev=2.0 + truth["dev"][seed])
    make_run(tmp_path, "rms_bias", 0, val_loss=5.3, tokens_per_s=1000.0, dev=2.0)
    make_run(tmp_path, "dyt", 7, val_loss=6.0, tokens_per_s=1100.0, dev=3.0)  # no partner seed
    return tmp_path, truth


def test_intervals_agree_with_an_independent_t_interval(known_sweep) -> None:
    root, truth = known_sweep
    comparison = load(sorted(p for p in root.iterdir() if p.is_dir()))
    estimates, unpaired = paired_estimates(run_measures(comparison))
    by_key = {(e.arm, e.other, e.metric): e for e in estimates}
    val = by_key[("layer", "rms", "val_loss")]
    assert val.seeds == (0, 1, 2) and val.values == pytest.approx(truth["val"])
    assert (val.mean, val.low, val.high) == pytest.approx(independent_interval(truth["val"]), rel=1e-9)
    for site in ("ln1.in", "ln2.in", "final.in", "ln1.out", "final.out", "all"):
        dev = by_key[("layer", "rms", f"ones_dev/{site}")]
        assert (dev.mean, dev.low, dev.high) == pytest.approx(independent_interval(truth["dev"]), rel=1e-9)
    # One seed of layer vs rms_bias: a difference, no interval.
    single = by_key[("layer", "rms_bias", "val_loss")]
    assert single.n == 1 and single.low is None and "one seed: no interval and no test" in sentence(single)
    assert single.outcome() == "no test" and single.test.p_diff is None
    # The dyt run has no partner seed: listed as unpaired, never dropped.
    assert list(unpaired["run"]) == ["dyt-s7"]


def test_the_words_say_what_the_numbers_support(known_sweep, tmp_path: Path) -> None:
    root, truth = known_sweep
    comparison = load(sorted(p for p in root.iterdir() if p.is_dir()))
    estimates, _ = paired_estimates(run_measures(comparison))
    by_key = {(e.arm, e.other, e.metric): e for e in estimates}
    # The primary statistic (the tail of the curve: here its last point), its own family: all three
    # differences positive and tight -> different, RMSNorm lower.
    primary = by_key[("layer", "rms", "val_loss/tail")]
    assert primary.primary and primary.family_size == 1 and primary.p_diff_holm == primary.test.p_diff < 0.05
    assert "different: RMSNorm reaches the lower validation loss, at 3 seeds" in sentence(primary)
    # The angle at ln1.in, all three differences positive, is not declared: described, no test words.
    angle = by_key[("layer", "rms", "ones_dev/ln1.in")]
    assert min(angle.values) > 0 and angle.family == "described" and angle.outcome() == "described"
    assert angle.p_diff_holm is None and sentence(angle).endswith("described, not tested).")
    assert not any(w in sentence(angle) for w in ("different", "equivalent", "inconclusive", "p ="))
    # The declared secondaries present here (energy, |angle
    # - 90| pooled, the final loss): Holm within these 3.
    secondary = [e for e in estimates if e.family == "secondary"]
    assert {e.metric for e in secondary} == {"ones_energy/window", "ones_dev/all", "val_loss"}
    assert {e.family_size for e in secondary} == {3} and all(e.power_diff is not None for e in secondary
                                                            if e.sd)
    out = tmp_path / "verdict"
    out.mkdir()
    written = write_verdict(comparison, out, ("png",))
    text = (out / "verdict.md").read_text()
    assert "## The primary question" in text and "dyt-s7" in text
    table = pd.read_csv(out / "verdict.csv")
    assert (
        set(table["metric"]) >= {"val_loss", "ones_dev/ln1.in"}
        and not table["metric"].str.contains("tokens").any()
    )
    assert {"margin", "ci95_low", "ci95_high", "ci90_low", "ci90_high", "p_diff", "p_diff_holm", "p_tost",
            "p_tost_holm", "power_diff", "power_tost", "family", "primary", "sentence"} <= set(table.columns)
    assert list(table[table["primary"]]["metric"]) == ["val_loss/tail"]
    described = table[table["family"] == "described"]
    assert set(described["outcome"]) <= {"described", "no test"} and described["p_diff_holm"].isna().all()
    assert (table["family"] == "secondary").sum() <= 6
    assert (out / "verdict.png").stat().st_size > 5000 and (out / "val_curve_diff.png").stat().st_size > 5000
    assert len(written) == 4
    assert "## Declared secondary questions" in text and "## Described, not tested" in text
    # One table per family: the primary's row and its sentence; the described rows without sentences.
    assert "| LayerNorm − RMSNorm | `val_loss/tail` | 3 |" in text
    assert "|ln1.in at" not in text and "at ln1.in: LayerNorm" not in text
    # Per arm, described: 1 inside the null band at every first-step record, at none of the last step's.
    assert "| 100% / 0% |" in next(
        line for line in text.splitlines() if line.startswith("| LayerNorm | toy | pre | 3")
    )


def test_an_interval_containing_zero_and_wider_than_the_margin_reads_inconclusive(tmp_path: Path) -> None:
    for seed, diff in enumerate((0.05, -0.04, 0.01)):
        make_run(tmp_path, "rms", seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
        make_run(tmp_path, "layer", seed, val_loss=5.0 + diff, tokens_per_s=1000.0, dev=1.0)
    estimates, unpaired = paired_estimates(run_measures(load(sorted(tmp_path.iterdir()))))
    val = next(e for e in estimates if e.metric == "val_loss/tail")
    assert val.low < 0 < val.high and val.outcome() == "inconclusive"
    assert (
        sentence(val).endswith(
            "inconclusive at 3 seeds (the 90% interval is wider than the margin ±0.02 nats; "
            "nor is a difference resolved)."
        )
        and unpaired.empty
    )


def test_throughput_is_not_a_verdict_measure_its_runs_share_the_machine(tmp_path: Path) -> None:
    """Runs that logged per-step tokens/s (a load burst in one arm): the
    verdict neither measures nor contrasts throughput (bench/norm_cost.py
    times the norms, interleaved); no margin key or metric names it."""
    for seed in range(2):
        make_run(tmp_path, "rms", seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0, step_rates=(1000.0,) * 5)
        make_run(tmp_path, "layer", seed, val_loss=5.0, tokens_per_s=500.0, dev=1.0, step_rates=(300.0,) * 5)
    measures = run_measures(load(sorted(tmp_path.iterdir())))
    assert not [c for c in measures.columns if "tokens" in c]
    estimates, _ = paired_estimates(measures)
    assert estimates and not [e for e in estimates if "tokens" in e.metric]
    assert not [k for k in (*MARGIN_KEYS, *METRICS) if "tokens" in k]
    assert "tokens" not in MARGINS_FILE.read_text().split("primary:")[0]


def test_one_seed_per_arm_says_once_that_no_interval_or_test_is_possible(tmp_path: Path) -> None:
    make_run(tmp_path / "runs", "rms", 0, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    make_run(tmp_path / "runs", "layer", 0, val_loss=5.1, tokens_per_s=1000.0, dev=1.5)
    (tmp_path / "c").mkdir()
    write_verdict(load(sorted((tmp_path / "runs").iterdir())), tmp_path / "c", ("png",))
    text = (tmp_path / "c" / "verdict.md").read_text()
    assert text.lower().count(ONE_SEED) == 1 and text.count("no interval") == 1
    assert "| LayerNorm − RMSNorm | `val_loss/tail` | 1 | +0.1000 | - |" in text
    assert len(text.splitlines()) < 60  # the old verdict of two smoke runs: ~90 lines of one-seed sentences


def test_every_registry_contrast_names_two_registered_arms() -> None:
    pairs = {(arm, other) for arm, other, _ in contrasts()}
    assert {
        ("layer", "rms"),
        ("layer_nobias", "rms"),
        ("layer", "rms_bias"),
        ("layer", "layer_nobias"),
    } <= pairs
    assert {(arm, "dyt") for arm in ("layer", "rms", "layer_nobias", "rms_bias")} <= pairs
    assert all(arm in NORM_ARMS and other in NORM_ARMS for arm, other in pairs)


@pytest.mark.slow
def test_a_toy_arm_defined_in_a_test_trains_probes_and_is_judged(tmp_path: Path) -> None:
    """The toy arm (tests/toy_arm.py) through the real train.py, the probe, normgeo.compare and the
    verdict."""
    import subprocess

    out = tmp_path / "sweep"
    args = [sys.executable, str(ROOT / "tests" / "toy_arm.py"), "-m", *FAST, f"output_root={out}",
            f"data_root={tmp_path / 'data'}", *ARM_SETTINGS, "val_every=3", "val_sequences=8",
            f"norm=layer,{toy_arm.TOY}", "seed=0,1"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(out.glob(f"*{toy_arm.TOY}*"))
    assert len(runs) == 2
    rows = [json.loads(line) for line in (runs[0] / "angles.jsonl").read_text().splitlines()]
    assert {r["norm"] for r in rows} == {toy_arm.TOY}
    # found as an rms-kind norm
    assert {"ln1.in", "ln1.std", "ln1.out", "final.out"} <= {r["site"] for r in rows}
    toy_arm.register()
    try:
        assert compare_main([str(out), "--formats", "png", "--refs=ones"]) == 0  # the verdict is the point
        table = pd.read_csv(out / "compare" / "verdict.csv")
        toy = table[(table["arm"] == toy_arm.TOY) & (table["other"] == "layer")]
        assert set(toy["metric"]) >= {"val_loss", "ones_dev/ln1.in"} and set(toy["n_seeds"]) == {2}
        assert "toy L2 norm − LayerNorm" in (out / "compare" / "verdict.md").read_text()
    finally:
        unregister_arm(toy_arm.TOY)


# --- equivalence, difference, inconclusive and the family,
# on constructed per-seed values --------------------

CONFIG = load_verdict_config()


def measures_of(per_metric: dict[str, list[float]], *, arms=("layer", "rms")) -> pd.DataFrame:
    """Per-run rows of ``arms`` over seeds: the other arm at 0, the first arm at the given per-seed
    difference; every metric not given is unmeasured."""
    seeds = len(next(iter(per_metric.values())))
    rows = []
    for seed in range(seeds):
        for norm in arms:
            row = {"run": f"{norm}-s{seed}", "norm": norm, "size": "toy", "placement": "pre", "seed": seed,
                   **{m: None for m in METRICS}}
            for name, values in per_metric.items():
                row[name] = values[seed] if norm == arms[0] else 0.0
            rows.append(row)
    return pd.DataFrame(rows)


def independent_tost(values, margin: float) -> tuple[float, float, float]:
    """TOST p (the larger one-sided p) and the 90% interval from scipy's t distribution, by hand."""
    x = np.asarray(values, dtype=float)
    n, mean, se = x.size, x.mean(), x.std(ddof=1) / math.sqrt(x.size)
    p_low = stats.t.sf((mean + margin) / se, n - 1)   # H0: difference <= -margin
    p_high = stats.t.cdf((mean - margin) / se, n - 1)  # H0: difference >= +margin
    q = stats.t.ppf(0.95, n - 1)
    return max(p_low, p_high), mean - q * se, mean + q * se


def by_metric(estimates) -> dict:
    return {e.metric: e for e in estimates if (e.arm, e.other) == ("layer", "rms")}


def test_equivalence_is_shown_when_the_90_percent_interval_lies_inside_the_margin() -> None:
    diffs = [0.003, -0.002, 0.001, 0.0, -0.0015, 0.002]
    estimate = by_metric(paired_estimates(measures_of({"val_loss/tail": diffs}), CONFIG)[0])["val_loss/tail"]
    p_tost, low90, high90 = independent_tost(diffs, 0.02)
    assert estimate.primary and estimate.margin == 0.02
    assert estimate.test.p_tost == pytest.approx(p_tost, rel=1e-9) and estimate.ci90 == pytest.approx(
        (low90, high90)
    )
    assert -0.02 < low90 < high90 < 0.02 and estimate.p_tost_holm == estimate.test.p_tost < 0.05
    assert estimate.outcome() == "equivalent"
    assert sentence(estimate).endswith("equivalent within ±0.02 nats, at 6 seeds.")
    # A tighter margin than the data resolve: the same values are no longer shown equivalent.
    tight = load_verdict_config(overrides=["val_loss=0.001"])
    narrow = by_metric(paired_estimates(measures_of({"val_loss/tail": diffs}), tight)[0])["val_loss/tail"]
    assert narrow.margin == 0.001 and narrow.outcome() == "inconclusive"
    assert "the 90% interval is wider than the margin ±0.001 nats" in sentence(narrow)
    assert not any(word in sentence(narrow) for word in ("equivalent", "the same", "holds", "no difference"))


def test_a_difference_is_shown_when_the_adjusted_t_test_rejects() -> None:
    diffs = [0.10, 0.12, 0.11, 0.09]
    estimate = by_metric(paired_estimates(measures_of({"val_loss/tail": diffs}), CONFIG)[0])["val_loss/tail"]
    assert estimate.test.p_diff == pytest.approx(stats.ttest_1samp(diffs, 0.0).pvalue, rel=1e-9)
    assert estimate.outcome() == "different" and estimate.test.p_tost > 0.5
    assert "different: RMSNorm reaches the lower validation loss, at 4 seeds." in sentence(estimate)


def test_an_uncorrected_p_below_005_does_not_survive_holm_in_the_secondary_family() -> None:
    """Four declared secondary endpoints (and the primary, its own family): Holm by hand on their four
    p-values; an undeclared metric is described, whatever its raw p."""
    per_metric = {
        "val_loss/tail": [0.001, 0.002, -0.001, 0.0],       # primary
        "val_loss": [0.030, 0.010, 0.045, 0.020],           # p ~ 0.03: raw < 0.05
        "ones_energy/window": [0.001, -0.001, 0.002, -0.002],
        "ones_dev/ln1.in": [0.5, -0.3, 0.8, 0.1],
        "rank_pct/window": [4.0, -2.0, 1.0, 6.0],
        "band_margin/window": [3.0, 3.1, 2.9, 3.0],         # undeclared, raw p tiny
    }
    declared = tuple(
        Endpoint("layer", "rms", m)
        for m in ("val_loss", "ones_energy/window", "ones_dev/ln1.in", "rank_pct/window")
    )
    config = load_verdict_config()
    config = type(config)(config.margins, config.primary, declared, config.alpha)
    estimates, _ = paired_estimates(measures_of(per_metric), config)
    found = by_metric(estimates)
    family = [found[e.metric] for e in declared]
    assert {e.family for e in family} == {"secondary"} and {e.family_size for e in family} == {4}
    raw = [e.test.p_diff for e in family]
    # Holm by hand: sort, multiply the i-th smallest by (m - i), running maximum, at most 1.
    order = sorted(range(4), key=lambda i: raw[i])
    by_hand, running = [0.0] * 4, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (4 - rank) * raw[i]))
        by_hand[i] = running
    assert [e.p_diff_holm for e in family] == pytest.approx(by_hand, rel=1e-12)
    final = found["val_loss"]
    assert final.test.p_diff < 0.05 <= final.p_diff_holm
    assert final.outcome() == "inconclusive" and "different" not in sentence(final)
    # TOST is adjusted in the same family; the primary row is adjusted only within its own (one test).
    assert [e.p_tost_holm for e in family] == pytest.approx(
        list(multipletests([e.test.p_tost for e in family], method="holm")[1]), rel=1e-12)
    primary = found["val_loss/tail"]
    assert primary.primary and primary.family_size == 1 and primary.p_tost_holm == primary.test.p_tost
    band = found["band_margin/window"]
    assert band.test.p_diff < 1e-4 and band.family == "described" and band.outcome() == "described"
    # Each declared row's power at its observed SD, at Holm's first-step level alpha / 4.
    sd = float(np.std(per_metric["val_loss"], ddof=1))
    assert final.power_diff == pytest.approx(difference_power(4, sd, 0.02, 0.05 / 4))
    assert final.power_tost == pytest.approx(tost_power(4, sd, 0.02, 0.0, 0.05 / 4))
    assert final.power_diff == pytest.approx(
        simulated_power(4, sd, 0.02, "difference", level=0.05 / 4), abs=0.015
    )


def test_every_metric_is_one_record_with_its_words_unit_and_margin_key() -> None:
    assert set(metric(m).margin_key for m in METRICS) <= set(MARGIN_KEYS)
    assert {f"ones_dev/{site}" for site in SITE_CLASSES} | {"ones_dev/all"} <= set(METRICS)
    loss = metric("val_loss/tail")
    assert loss.margin_text(0.02) == "±0.02 nats" and loss.number(0.01234) == "+0.0123"
    assert loss.which(-0.1, "LayerNorm", "RMSNorm") == "LayerNorm reaches the lower validation loss"
    assert (
        metric("ones_dev/ln1.in").which(0.5, "LayerNorm", "RMSNorm")
        == "1 is closer to orthogonal under RMSNorm"
    )
    assert metric("downstream/task/acc").margin_key == "downstream"
    with pytest.raises(KeyError):
        metric("tokens_per_s_ratio")


def write_margins(tmp_path: Path, secondary: list[dict]) -> Path:
    raw = yaml.safe_load(MARGINS_FILE.read_text())
    raw["secondary"] = secondary
    path = tmp_path / "margins.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("secondary", "says"),
    [
        (
            [{"arm": "layer", "other": "rms", "metric": f"ones_dev/{s}"} for s in (*SITE_CLASSES, "all")],
            "at most 6",
        ),
        ([{"arm": "layer", "other": "rms", "metric": "tokens_per_s_ratio"}], "not a verdict metric"),
        ([{"arm": "layer", "other": "intact", "metric": "val_loss"}], "intact"),
        ([{"arm": "layer", "other": "rms", "metric": "val_loss/tail"}], "declared twice"),
    ],
)
def test_a_bad_secondary_declaration_is_one_line_exit_2(
    tmp_path: Path, capsys, secondary: list, says: str
) -> None:
    make_run(tmp_path / "runs", "layer", 0, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    margins = write_margins(tmp_path, secondary)
    assert (
        compare_main([str(tmp_path / "runs"), "--margins", str(margins), "--out", str(tmp_path / "c")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0]
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("override", ["val_loss=-1", "val_loss=abc", "nonsense=0.1", "val_loss"])
def test_a_bad_margin_is_one_line_exit_2_and_nothing_written(tmp_path: Path, capsys, override: str) -> None:
    make_run(tmp_path / "runs", "layer", 0, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    assert compare_main([str(tmp_path / "runs"), "--margin", override, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and ("margin" in err[0])
    assert not (tmp_path / "c").exists()


def test_geometry_is_pooled_within_a_run_then_windowed_over_the_last_30_percent_of_probes(
    tmp_path: Path,
) -> None:
    """11 probes (steps 0..100): per step the mean over every (layer, site) record; the window is the last
    4 probe steps (ceil(0.3 * 11)); the band edge distance is min(rank - 5, 95 - rank) per record."""
    run = make_run(tmp_path, "rms", 0, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    null, energy, truth = [], [], {}
    for step in range(0, 101, 10):
        ranks = [50 + step * 0.45 + layer for layer in range(3) for _ in range(2)]  # 2 sites per layer
        null += [
            {
                "model": "m",
                "norm": "rms",
                "step": step,
                "layer": i // 2,
                "site": ("ln1.in", "ln1.out")[i % 2],
                "mean_rank_pct": r,
                "in_null_band": 5 <= r <= 95,
            }
            for i, r in enumerate(ranks)
        ]
        energy += [
            {
                "model": "m",
                "norm": "rms",
                "step": step,
                "layer": layer,
                "site": "ln1.in",
                "quantity": "ones_fraction",
                "mean": 0.01 + step / 1e4 + layer / 1e3,
            }
            for layer in range(3)
        ]
        truth[step] = (np.mean(ranks), np.mean([min(r - 5, 95 - r) for r in ranks]),
                       np.mean([0.01 + step / 1e4 + layer / 1e3 for layer in range(3)]))
    (run / "null.jsonl").write_text("".join(json.dumps(r) + "\n" for r in null))
    (run / "energy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in energy))
    measured = geometry_measures(run)
    window = [70, 80, 90, 100]
    for i, kind in enumerate(("rank_pct", "band_margin", "ones_energy")):
        assert measured[f"{kind}/last"] == pytest.approx(truth[100][i])
        assert measured[f"{kind}/window"] == pytest.approx(np.mean([truth[s][i] for s in window]))
    assert measured["band_margin/last"] < 0 < measured["band_margin/window"]  # the last probe alone: outside
    assert measured["in_band_first"] == 1.0 and 0 < measured["in_band_last"] < 1


# --- seeds planned
# ---------------------------------------------------------------------------------------------


def simulated_power(n: int, sd: float, margin: float, test: str, reps: int = 20_000, seed: int = 0,
                    level: float = 0.05) -> float:
    """Monte-Carlo power of the paired tests at ``level`` with scipy's t quantiles (not the planner's
    code)."""
    rng = np.random.default_rng(seed)
    true = margin if test == "difference" else 0.0
    x = rng.normal(true, sd, size=(reps, n))
    mean, se = x.mean(axis=1), x.std(axis=1, ddof=1) / math.sqrt(n)
    if test == "difference":
        return float(np.mean(np.abs(mean / se) > stats.t.ppf(1 - level / 2, n - 1)))
    q = stats.t.ppf(1 - level, n - 1)
    return float(np.mean((mean - q * se > -margin) & (mean + q * se < margin)))


@pytest.mark.parametrize(("n", "sd", "margin"), [(4, 1.0, 2.0), (8, 1.0, 1.0), (20, 0.04, 0.02)])
def test_tost_power_agrees_with_a_simulation(n: int, sd: float, margin: float) -> None:
    simulated = simulated_power(n, sd, margin, "equivalence")
    assert tost_power(n, sd, margin) == pytest.approx(simulated, abs=0.015)  # 3 SE of 20,000 draws ~ 0.01


def test_seeds_for_a_margin_reach_80_percent_power_in_a_simulation() -> None:
    sd, margin = 0.03, 0.02
    equivalence = seeds_for_equivalence(sd, margin)
    assert simulated_power(equivalence, sd, margin, "equivalence") >= 0.78
    assert simulated_power(equivalence - 1, sd, margin, "equivalence") < 0.81
    difference = seeds_for_difference(sd, margin)
    assert simulated_power(difference, sd, margin, "difference") >= 0.78
    assert simulated_power(difference - 1, sd, margin, "difference") < 0.81
    # showing |d| < margin at d = 0 needs more seeds than detecting d = margin
    assert equivalence > difference


def write_intervention(run_dir: Path, action: str, delta_losses: dict[int, float]) -> None:
    """intervention.jsonl's all-norms rows of a run: the loss change at each probe step."""
    rows = [{"model": "m", "norm": "x", "step": step, "scope": "all", "action": action, "delta_loss": value}
            for step, value in delta_losses.items()]
    rows.append(
        {"model": "m", "norm": "x", "step": 10, "scope": "layer", "action": action, "delta_loss": 9.0}
    )
    (run_dir / "intervention.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_centering_intervention_is_judged_per_arm_against_the_intact_model(tmp_path: Path) -> None:
    """Per arm, the run's loss change (all norms, last 30% of probes / last
    probe) over seeds against 0: taking LayerNorm's centering out costs
    nothing within the margin here, putting it into RMSNorm costs 0.1 nats."""
    # steps 0, 5, 10
    removed = {0: [0.001, 0.002, -0.001], 1: [0.000, 0.001, 0.002], 2: [0.002, 0.000, 0.001]}
    added = {0: [0.01, 0.09, 0.10], 1: [0.02, 0.11, 0.12], 2: [0.00, 0.10, 0.09]}
    for seed in range(3):
        for norm, action, values in (("layer", "remove", removed), ("rms", "add", added)):
            run_dir = make_run(tmp_path, norm, seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
            write_intervention(run_dir, action, dict(zip((0, 5, 10), values[seed], strict=True)))
    comparison = load(sorted(p for p in tmp_path.iterdir() if p.is_dir()))
    estimates, _ = paired_estimates(run_measures(comparison))
    per_arm = {(e.arm, e.metric): e for e in estimates if e.other == "intact"}
    assert set(per_arm) == {
        (arm, f"intervention_dloss/{at}") for arm in ("layer", "rms") for at in ("window", "last")
    }
    # Declared secondaries: each arm's window statistic, in one family with the three layer-vs-rms endpoints
    # these runs also have (energy, |angle - 90| pooled, final loss); the last probe's statistic is described.
    assert {k for k, e in per_arm.items() if e.family == "secondary"} == {
        ("layer", "intervention_dloss/window"),
        ("rms", "intervention_dloss/window"),
    }
    assert {e.family_size for e in per_arm.values() if e.tested} == {5}
    last = per_arm[("layer", "intervention_dloss/last")]
    # the all-norms rows only
    assert last.values == pytest.approx([values[-1] for values in removed.values()])
    window = per_arm[("rms", "intervention_dloss/window")]  # the last 30% of 3 probes: the last one
    assert window.values == pytest.approx([values[-1] for values in added.values()])
    assert (window.mean, window.low, window.high) == pytest.approx(independent_interval(window.values))
    assert last.family == "described" and sentence(last).endswith("described, not tested).")
    removal = per_arm[("layer", "intervention_dloss/window")]
    assert "free within ±0.02 nats (equivalent to the intact model), at 3 seeds" in sentence(removal)
    assert window.outcome() == "different"
    assert "putting the mean subtraction into every norm of the trained model raises the loss" in sentence(
        window
    )
    # Between the arms, the intervention's loss change is described like any undeclared metric.
    contrast = {(e.arm, e.other, e.metric): e for e in estimates}[("layer", "rms", "intervention_dloss/last")]
    assert contrast.family == "described" and contrast.values == pytest.approx(
        [r[-1] - a[-1] for r, a in zip(removed.values(), added.values(), strict=True)])


@pytest.mark.parametrize(("text", "says"), [
    ("secondry: []\n", "secondry: no such key (did you mean secondary? the keys are margins, primary, "),
    ("primray: {arm: rms, other: layer, metric: val_loss}\n", "primray: no such key (did you mean primary?"),
    ("- val_loss\n- 0.02\n", "expected a mapping of margins, primary, secondary, alpha, not a list"),
    ("alpha: abc\n", "alpha=abc: expected a level between 0 and 0.5"),
    ("margins: [0.02]\n", "margins: expected a mapping of metric key: margin, not a list"),
    ("margins: {val_los: 0.02}\n", "margins.val_los: unknown metric key (did you mean val_loss?"),
    ("secondary:\n  - {arm: layer, other: rms, metric: val_loss, metirc: val_loss}\n",
     "secondary[0].metirc: no such key (did you mean metric?"),
])
def test_a_margins_file_is_read_strictly_naming_the_file_and_key(
    tmp_path: Path, capsys, text: str, says: str
) -> None:
    """Issue 52, class 3: a misspelled key is refused with the nearest valid one (not ignored: no secondary
    question, or the default primary tested), a wrong type names the file, the key and what is expected."""
    make_run(tmp_path / "runs", "layer", 0, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    raw = yaml.safe_load(MARGINS_FILE.read_text())
    given = yaml.safe_load(text)
    margins = tmp_path / "margins.yaml"
    margins.write_text(text if not isinstance(given, dict) or "margins" in given else
                       yaml.safe_dump({"margins": raw["margins"]}) + text)
    assert (
        compare_main([str(tmp_path / "runs"), "--margins", str(margins), "--out", str(tmp_path / "c")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {margins}: ") and says in err[0], err
    assert not (tmp_path / "c").exists()


def test_a_binary_margins_file_is_one_line_naming_it(tmp_path: Path, capsys) -> None:
    make_run(tmp_path / "runs", "layer", 0, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    margins = tmp_path / "margins.yaml"
    margins.write_bytes(bytes(range(256)))
    assert (
        compare_main([str(tmp_path / "runs"), "--margins", str(margins), "--out", str(tmp_path / "c")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {margins}: cannot read the margins file (UnicodeDecodeError); give a YAML file like "
        "conf/compare/margins.yaml"
    ]


def test_the_verdict_page_names_the_margins_file_it_used(tmp_path: Path) -> None:
    make_run(tmp_path / "runs", "rms", 0, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
    make_run(tmp_path / "runs", "layer", 0, val_loss=5.1, tokens_per_s=1000.0, dev=1.5)
    mine = tmp_path / "my-margins.yaml"
    mine.write_text(MARGINS_FILE.read_text())
    (tmp_path / "c").mkdir()
    write_verdict(
        load(sorted((tmp_path / "runs").iterdir())), tmp_path / "c", ("png",), load_verdict_config(mine)
    )
    text = (tmp_path / "c" / "verdict.md").read_text()
    assert "my-margins.yaml`" in text and "conf/compare/margins.yaml" not in text


def test_runs_that_differ_besides_the_norm_are_not_paired_and_say_where(tmp_path: Path) -> None:
    """Issue 52, class 4: the same size name at another depth is not LayerNorm − RMSNorm. Pairing reads the
    whole recorded config: a pair that differs in anything but the arm (and what a resume may change: where,
    how it reports) is listed unpaired, naming the setting; one that differs only there is paired."""
    for seed in (0, 1):
        make_run(tmp_path / "runs", "rms", seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
        make_run(tmp_path / "runs", "layer", seed, val_loss=5.1, tokens_per_s=1000.0, dev=1.5)
    deeper = tmp_path / "runs" / "layer-s1" / "run_config.yaml"
    deeper.write_text(yaml.safe_dump({**yaml.safe_load(deeper.read_text()), "logger": {"csv": {}},
                                      "size": {"name": "toy", "n_layer": 6}, "output_root": "elsewhere"}))
    shallow = tmp_path / "runs" / "rms-s1" / "run_config.yaml"
    shallow.write_text(yaml.safe_dump({**yaml.safe_load(shallow.read_text()),
                                       "size": {"name": "toy", "n_layer": 4}}))
    measures = run_measures(load(sorted((tmp_path / "runs").iterdir())))
    estimates, unpaired = paired_estimates(measures)
    layer_rms = [e for e in estimates if (e.arm, e.other, e.metric) == ("layer", "rms", "val_loss")]
    assert [e.n for e in layer_rms] == [1]  # seed 0 only
    assert dict(zip(unpaired["run"], unpaired["why"], strict=True)) == {
        "layer-s1": "differs from rms-s1 in size.n_layer: 6 vs 4",
        "rms-s1": "differs from layer-s1 in size.n_layer: 4 vs 6"}
    (tmp_path / "c").mkdir()
    write_verdict(load(sorted((tmp_path / "runs").iterdir())), tmp_path / "c", ("png",))
    assert "seed 1, size toy, pre-norm): differs from rms-s1 in size.n_layer: 6 vs 4" in (
        tmp_path / "c" / "verdict.md").read_text()
