"""``python -m normgeo.compare`` on a real 2-norm x 2-seed sweep (conftest ``arms_sweep``): the tidy
tables hold every record, the summary's numbers are the runs' own, and the figures are written as PNG
and PDF."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from normgeo.compare import main as compare_main
from normgeo.measure.records import read_rows
from normgeo.report import main as report_main
from tests.conftest import step_losses

pytestmark = pytest.mark.slow  # trained runs shared by the module (the quick tier skips them)

RUNS = [f"tiny-{norm}-s{seed}" for norm in ("layer", "rms") for seed in (0, 1)]


@pytest.fixture(scope="module")
def compared(arms_sweep) -> Path:
    root = arms_sweep[0]
    assert compare_main([str(root), "--formats", "png,pdf"]) == 0
    return root


def test_tidy_tables_hold_every_record_of_both_arms(compared: Path) -> None:
    out = compared / "compare"
    angles = pd.read_parquet(out / "angles.parquet")
    assert set(angles["run"]) == set(RUNS)
    for run in RUNS:
        rows = read_rows(compared / run / "angles.jsonl")
        mine = angles[angles["run"] == run]
        assert len(mine) == len(rows) == 3 * 45  # steps x refs x (5 norms x {in, std, out})
        assert set(mine["arm"]) == {run.split("-")[1]} and set(mine["seed"]) == {int(run[-1])}
        by_key = {(r["step"], str(r["layer"]), r["site"], r["ref"]): r for r in rows}
        for rec in mine.itertuples():
            source = by_key[(rec.step, rec.layer, rec.site, rec.ref)]
            assert (rec.mean_deg, rec.p05, rec.p95) == (source["mean_deg"], source["p05"], source["p95"])
    assert len(pd.read_csv(out / "angles.csv")) == len(angles)
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert {"train/loss", "train/lr"} <= set(metrics["metric"])


def test_summary_numbers_are_the_runs_own(compared: Path) -> None:
    summary = pd.read_csv(compared / "compare" / "summary.csv")
    assert list(zip(summary["arm"], summary["seed"], strict=True)) == [
        ("layer", 0),
        ("layer", 1),
        ("rms", 0),
        ("rms", 1),
    ]
    summary = summary.set_index("run")
    for run in RUNS:
        row = summary.loc[run]
        rows = read_rows(compared / run / "angles.jsonl")
        assert row["final_step"] == 3 and row["tokens"] == 3 * 8 * 64
        # The last logged train loss (the 3rd update's, at step 3), from the run's own metrics.csv.
        assert row["train_loss"] == pytest.approx(step_losses(compared / run)[3])
        for site in ("ln1.in", "ln1.out", "ln2.in", "final.in"):
            final = [
                r["mean_deg"] for r in rows if r["step"] == 3 and r["site"] == site and r["ref"] == "ones"
            ]
            assert row[f"ones_deg/{site}"] == pytest.approx(sum(final) / len(final))
        # Wall time and tokens/s: the run's own summary.json (written by train.py).
        end = json.loads((compared / run / "summary.json").read_text())
        assert (row["wall_s"], row["tokens_per_s"]) == (end["wall_s"], end["tokens_per_s"])
    # LayerNorm's output is orthogonal to 1 up to its bias (zero-initialised, 3 steps of training).
    assert abs(summary.loc["tiny-layer-s0", "ones_deg/ln1.out"] - 90) < 0.5
    assert "| layer | 0 | tiny-layer-s0 | 3 |" in (compared / "compare" / "summary.md").read_text()


def test_overlay_and_loss_figures_in_png_and_pdf(compared: Path) -> None:
    out = compared / "compare"
    for stem in ("overlay_ln1.in_ones", "overlay_final.out_rand_a", "loss"):
        for fmt in ("png", "pdf"):
            assert (out / f"{stem}.{fmt}").stat().st_size > 1000, stem
    # sites ({ln1,ln2,final} x {in,std,out}) x references
    assert len(list(out.glob("overlay_*.png"))) == 9 * 3


def test_factorial_figures_from_the_runs_ellipsoid_and_energy_records(compared: Path, tmp_path: Path) -> None:
    for run in RUNS:
        ellipsoid = read_rows(compared / run / "ellipsoid.jsonl")
        assert len(ellipsoid) == len({r["step"] for r in ellipsoid}) * 5  # ln1, ln2 per block and ln_f
        # At init every gain is 1: LayerNorm's hyperellipsoid
        # and RMSNorm's ellipsoid are spheres of radius sqrt(d).
        assert all(r["condition"] == pytest.approx(1) for r in ellipsoid if r["step"] == 0)
        assert len(read_rows(compared / run / "energy.jsonl")) == len({r["step"] for r in ellipsoid}) * 5 * 2
    for stem in ("ellipsoid", "energy", "factorial_ones"):
        assert (compared / "compare" / f"{stem}.png").stat().st_size > 1000, stem
    # normgeo.report on several runs draws the same figures through the same code.
    assert report_main([str(compared / run) for run in RUNS[::2]] + ["--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.glob("*.png")} >= {"ellipsoid.png", "energy.png", "factorial_ones.png"}


def test_the_verdict_of_real_runs_tests_the_pooled_geometry_against_an_independent_computation(
    compared: Path,
) -> None:
    """verdict.csv of the real 2 x 2 sweep: its columns, the primary flag, and the rank of 1 among the random
    directions (pooled per run over layers and site classes at the last probe) re-computed from null.jsonl,
    with its paired t-test and TOST from scipy's t distribution."""
    import math

    import numpy as np
    from scipy import stats

    table = pd.read_csv(compared / "compare" / "verdict.csv")
    assert {"margin", "ci95_low", "ci95_high", "ci90_low", "ci90_high", "p_diff", "p_diff_holm", "p_tost",
            "p_tost_holm", "primary", "family", "sentence"} <= set(table.columns)
    layer_rms = table[(table["arm"] == "layer") & (table["other"] == "rms")].set_index("metric")
    assert bool(layer_rms.loc["val_loss/tail", "primary"]) and table["primary"].sum() == 1

    def pooled_rank(run: str) -> float:
        rows = [r for r in read_rows(compared / run / "null.jsonl") if r["step"] is not None]
        last = max(r["step"] for r in rows)
        return float(np.mean([r["mean_rank_pct"] for r in rows if r["step"] == last]))

    diffs = [pooled_rank(f"tiny-layer-s{seed}") - pooled_rank(f"tiny-rms-s{seed}") for seed in (0, 1)]
    row = layer_rms.loc["rank_pct/last"]
    assert row["n_seeds"] == 2 and row["mean"] == pytest.approx(np.mean(diffs))
    # An endpoint not declared in conf/compare/margins.yaml is described: its interval, no test.
    mean, se = np.mean(diffs), np.std(diffs, ddof=1) / math.sqrt(2)
    half = stats.t.ppf(0.95, 1) * se
    assert row["ci90_low"] == pytest.approx(mean - half, rel=1e-6) and row["ci90_high"] == pytest.approx(
        mean + half, rel=1e-6
    )
    assert row["family"] == "described" and math.isnan(row["p_diff"]) and math.isnan(row["p_tost"])
    # Where the mean lives, from mean_sources.jsonl at the last probe: described rows, never tested.
    def mean_sources(run: str) -> tuple[float, float]:
        rows = [r for r in read_rows(compared / run / "mean_sources.jsonl") if r["step"] is not None]
        last = [r for r in rows if r["step"] == max(r["step"] for r in rows)]
        first = [r["mean_sq_share"] for r in last if r["kind"] == "position" and r["bucket"] == "0"]
        top8 = [r["top8_share"] for r in last if r["kind"] == "dimensions"]
        return float(np.mean(first)), float(np.mean(top8))

    for metric, index in (("mean_first/last", 0), ("mean_top8/last", 1)):
        diffs = [mean_sources(f"tiny-layer-s{seed}")[index] - mean_sources(f"tiny-rms-s{seed}")[index]
                 for seed in (0, 1)]
        row = layer_rms.loc[metric]
        assert row["n_seeds"] == 2 and row["mean"] == pytest.approx(np.mean(diffs)), metric
        assert row["family"] == "described" and math.isnan(row["p_diff"]), metric
    text = (compared / "compare" / "verdict.md").read_text()
    assert "## Described, not tested" in text and "## Declared secondary questions" in text
    assert "| `mean_first/last` | 2 |" in text and "| `mean_top8/last` | 2 |" in text
