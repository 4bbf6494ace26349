"""The verdict of normgeo.compare: paired contrasts over seeds with t-intervals, checked against an
independent computation (scipy's one-sample t-test) on runs built with known differences; and a toy arm
defined only in a test, trained by the real train.py, probed, compared and judged."""

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

from models.norms import NORM_ARMS, contrasts, unregister_arm
from normgeo.compare import main as compare_main
from normgeo.figures.sweep import load
from normgeo.figures.verdict import paired_estimates, run_measures, sentence, write_verdict
from tests import toy_arm
from tests.conftest import ARM_SETTINGS, FAST, ROOT

SITES = {0: ("ln1", "ln2"), 1: ("ln1", "ln2"), "final": ("final",)}


def make_run(root: Path, norm: str, seed: int, *, val_loss: float, tokens_per_s: float, dev: float,
             in_band: tuple[bool, bool] = (True, False), energy: float = 0.01, placement: str = "pre",
             step_rates: tuple[float, ...] = ()) -> Path:
    """A run directory with the files the verdict reads, every |angle - 90| at the last step = ``dev``."""
    run_dir = root / f"{norm}{'-post' if placement == 'post' else ''}-s{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "run_config.yaml").write_text(yaml.safe_dump({
        "run_name": run_dir.name, "norm": {"name": norm}, "placement": {"name": placement}, "seed": seed,
        "size": {"name": "toy"}, "global_batch": 4, "seq_len": 8, "max_steps": 10}))
    angles, null, energy_rows = [], [], []
    for step, band in zip((0, 10), in_band, strict=True):
        for layer, roles in SITES.items():
            for role in roles:
                for suffix, sign in (("in", 1), ("out", -1)):
                    deg = 90 + sign * (dev if step == 10 else 1.0)
                    angles.append({"model": "m", "norm": norm, "step": step, "layer": layer, "site": f"{role}.{suffix}",
                                   "ref": "ones", "mean_deg": deg, "p05": deg - 3, "p95": deg + 3})
                    null.append({"step": step, "layer": layer, "site": f"{role}.{suffix}", "in_null_band": band})
                energy_rows.append({"step": step, "layer": layer, "site": f"{role}.in", "quantity": "ones_fraction",
                                    "mean": energy})
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
    speed = by_key[("layer", "rms", "tokens_per_s_ratio")]
    mean_log, low_log, high_log = independent_interval(np.log(truth["speed"]))
    assert (speed.mean, speed.low, speed.high) == pytest.approx((math.exp(mean_log), math.exp(low_log),
                                                                math.exp(high_log)), rel=1e-9)
    for site in ("ln1.in", "ln2.in", "final.in", "ln1.out", "final.out"):
        dev = by_key[("layer", "rms", f"ones_dev/{site}")]
        assert (dev.mean, dev.low, dev.high) == pytest.approx(independent_interval(truth["dev"]), rel=1e-9)
    # One seed of layer vs rms_bias: a difference, no interval.
    single = by_key[("layer", "rms_bias", "val_loss")]
    assert single.n == 1 and single.low is None and "one seed: no interval is possible" in sentence(single)
    # The dyt run has no partner seed: listed as unpaired, never dropped.
    assert list(unpaired["run"]) == ["dyt-s7"]


def test_the_words_say_what_the_numbers_support(known_sweep, tmp_path: Path) -> None:
    root, truth = known_sweep
    comparison = load(sorted(p for p in root.iterdir() if p.is_dir()))
    estimates, _ = paired_estimates(run_measures(comparison))
    by_key = {(e.arm, e.other, e.metric): e for e in estimates}
    # val: all three differences positive and tight -> RMSNorm lower; tokens/s all < 1 -> RMSNorm faster.
    assert by_key[("layer", "rms", "val_loss")].distinguishable()
    assert "RMSNorm reaches the lower validation loss, at 3 seeds" in sentence(by_key[("layer", "rms", "val_loss")])
    assert "RMSNorm trains faster" in sentence(by_key[("layer", "rms", "tokens_per_s_ratio")])
    out = tmp_path / "verdict"
    out.mkdir()
    written = write_verdict(comparison, out, ("png",))
    text = (out / "verdict.md").read_text()
    assert "## The paper's question: LayerNorm vs RMSNorm" in text and "dyt-s7" in text
    table = pd.read_csv(out / "verdict.csv")
    assert set(table["metric"]) >= {"val_loss", "tokens_per_s_ratio", "ones_dev/ln1.in"}
    assert (out / "verdict.png").stat().st_size > 5000 and len(written) == 3
    # Per arm: 1 inside the null band at every first-step record, at none of the last step's.
    assert "| LayerNorm | toy | pre | 3 | " in text and "| 100% | 0% |" in text


def test_an_interval_containing_zero_reads_not_distinguishable(tmp_path: Path) -> None:
    for seed, diff in enumerate((0.05, -0.04, 0.01)):
        make_run(tmp_path, "rms", seed, val_loss=5.0, tokens_per_s=1000.0, dev=1.0)
        make_run(tmp_path, "layer", seed, val_loss=5.0 + diff, tokens_per_s=1000.0, dev=1.0)
    estimates, unpaired = paired_estimates(run_measures(load(sorted(tmp_path.iterdir()))))
    val = next(e for e in estimates if e.metric == "val_loss")
    assert val.low < 0 < val.high and not val.distinguishable()
    assert sentence(val).endswith("not distinguishable at 3 seeds.") and unpaired.empty


def test_throughput_is_the_median_step_rate_so_probe_steps_and_load_bursts_do_not_decide_it(tmp_path: Path) -> None:
    """Per-step tokens/s with a slow probe step in one arm and a load burst in the other: the ratio is of
    the medians (the summary's wall-clock mean, deliberately wrong here, is only the fallback)."""
    for seed in range(2):
        make_run(tmp_path, "rms", seed, val_loss=5.0, tokens_per_s=1.0, dev=1.0,
                 step_rates=(1000.0, 1000.0, 40.0, 1000.0, 1000.0))  # step 3 held a probe
        make_run(tmp_path, "layer", seed, val_loss=5.0, tokens_per_s=999.0, dev=1.0,
                 step_rates=(900.0, 900.0, 900.0, 300.0, 300.0 + seed))  # a burst of load at steps 4-5
    measures = run_measures(load(sorted(tmp_path.iterdir())))
    assert sorted(measures["tokens_per_s"]) == [900.0, 900.0, 1000.0, 1000.0]
    estimates, _ = paired_estimates(measures)
    speed = next(e for e in estimates if e.metric == "tokens_per_s_ratio")
    assert speed.values == pytest.approx((0.9, 0.9))


def test_every_registry_contrast_names_two_registered_arms() -> None:
    pairs = {(arm, other) for arm, other, _ in contrasts()}
    assert {("layer", "rms"), ("layer_nobias", "rms"), ("layer", "rms_bias"), ("layer", "layer_nobias")} <= pairs
    assert {(arm, "dyt") for arm in ("layer", "rms", "layer_nobias", "rms_bias")} <= pairs
    assert all(arm in NORM_ARMS and other in NORM_ARMS for arm, other in pairs)


@pytest.mark.slow
def test_a_toy_arm_defined_in_a_test_trains_probes_and_is_judged(tmp_path: Path) -> None:
    """The toy arm (tests/toy_arm.py) through the real train.py, the probe, normgeo.compare and the verdict."""
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
    assert {"ln1.in", "ln1.std", "ln1.out", "final.out"} <= {r["site"] for r in rows}  # found as an rms-kind norm
    toy_arm.register()
    try:
        assert compare_main([str(out), "--formats", "png"]) == 0
        table = pd.read_csv(out / "compare" / "verdict.csv")
        toy = table[(table["arm"] == toy_arm.TOY) & (table["other"] == "layer")]
        assert set(toy["metric"]) >= {"val_loss", "ones_dev/ln1.in"} and set(toy["n_seeds"]) == {2}
        assert "toy L2 norm vs LayerNorm" in (out / "compare" / "verdict.md").read_text()
    finally:
        unregister_arm(toy_arm.TOY)
