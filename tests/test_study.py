"""The CPU study (docs/make_study.sh) in small: one pair of its arms (``layer`` and ``rms``, seed 0) with the
study preset on the real corpora, shortened, trained twice on this machine: every records file and every
logged loss is identical bit for bit (what docs/study.md says is bitwise); and the study page
(docs/study_page.py) renders the verdict of such a run tree with its new words."""

from __future__ import annotations

import importlib.util
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from normgeo.compare import main as compare_main
from normgeo.measure.stats import seeds_for_equivalence, smallest_decidable_margin
from tests.conftest import ROOT, metrics_rows
from tests.test_verdict import make_run

pytestmark = pytest.mark.slow  # four real study-preset runs

RECORDS = ("angles.jsonl", "null.jsonl", "energy.jsonl", "ellipsoid.jsonl", "intervention.jsonl")
SHORT = (
    "max_steps=10",
    "optim.warmup_steps=5",
    "checkpoint.steps=[5,10]",
    "checkpoint.last_every=0",
    "val_every=5",
    "log_every=5",
    "val_sequences=16",
    "probe.tokens=1024",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "probe.figures=false",  # a run's own figures: seconds each, and what is compared here are its records
)


def study_pair(output_root: Path, data_root: Path, shared: Path) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        "experiment=study_cpu",
        "seed=0",
        "norm=layer,rms",
        f"data.source.path={shared / 'corpora' / 'webtext'}",
        f"probe.path={shared / 'corpora' / 'wikipedia'}",
        f"output_root={output_root}",
        f"data_root={data_root}",
        *SHORT,
    ]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def twice(tmp_path_factory, shared: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("study")
    for name in ("a", "b"):
        done = study_pair(root / name, root / "data", shared)
        assert done.returncode == 0, done.stderr[-3000:]
    return root / "a", root / "b"


def test_a_rerun_of_a_study_pair_on_the_same_machine_gives_identical_records(
    twice: tuple[Path, Path],
) -> None:
    first, second = twice
    runs = sorted(p.name for p in first.iterdir() if (p / "angles.jsonl").is_file())
    assert runs == ["study-layer-s0", "study-rms-s0"]
    for run in runs:
        for name in RECORDS:
            assert (first / run / name).read_bytes() == (second / run / name).read_bytes(), f"{run}/{name}"
        for metric in ("train/loss", "val/loss"):
            a = [(r["step"], r[metric]) for r in metrics_rows(first / run) if r.get(metric)]
            b = [(r["step"], r[metric]) for r in metrics_rows(second / run) if r.get(metric)]
            assert a == b and len(a) == 2, (run, metric)  # steps 5 and 10


def load_study_page():
    spec = importlib.util.spec_from_file_location("study_page", ROOT / "docs" / "study_page.py")
    study_page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study_page)
    return study_page


def test_the_answer_states_the_margin_the_seeds_reach_and_the_gpu_plan(tmp_path: Path) -> None:
    """With several seeds the page says the primary outcome, the margin the seeds decide at the observed SD,
    the seeds the declared margin needs, and the same decision's GPU plan at 70m and 160m."""
    study_page = load_study_page()
    for seed, (layer, rms) in enumerate([(5.00, 5.01), (5.03, 5.01), (4.98, 5.00), (5.02, 5.02)]):
        make_run(tmp_path, "layer", seed, val_loss=layer, tokens_per_s=1.0, dev=1.0)
        make_run(tmp_path, "rms", seed, val_loss=rms, tokens_per_s=1.0, dev=1.0)
    estimate = study_page.primary_estimate(sorted(tmp_path.iterdir()))
    differences = [
        (layer + 0.5) - (rms + 0.5) for layer, rms in [(5.00, 5.01), (5.03, 5.01), (4.98, 5.00), (5.02, 5.02)]
    ]
    assert estimate.n == 4 and estimate.sd == pytest.approx(statistics.stdev(differences), abs=1e-9)
    text = study_page.answer_text(estimate)
    reach = smallest_decidable_margin(4, estimate.sd)
    assert f"decide equivalence within ±{reach:.3f} nats with 80% power" in text
    assert f"±0.02 nats would take {seeds_for_equivalence(estimate.sd, 0.02)} seeds" in text
    plan = study_page.gpu_plan_text(0.022, 0.02)
    assert "a plan from this CPU study's paired SD, not a measurement" in plan
    assert plan.count("| 12 |") == 4  # 70m and 160m on two GPUs: 12 seeds per arm at SD 0.022 (the pilot's)


def test_the_study_page_renders_the_verdict_with_its_words(twice: tuple[Path, Path], tmp_path: Path) -> None:
    out = twice[0]
    assert compare_main([str(out), "--formats", "png", "--refs=ones"]) == 0  # the page's figures
    (out / "wall_s.txt").write_text("60\n")
    (out / "disk_bytes.txt").write_text("1000\n")
    (out / "commands.txt").write_text(f"python train.py -m output_root={out}\n")
    study_page = load_study_page()
    # The second training of the pair stands in for the thread-count re-runs: nothing moved.
    page = study_page.main(out, figures_dir=tmp_path, details_dir=tmp_path, threads=twice[1])
    assert "### The primary question" in page and "### Declared secondary questions" in page
    assert len(page.splitlines()) <= 150 and "## Described" not in page  # the described rows: beside it
    assert "## Described, not tested" in (tmp_path / "study_details.md").read_text()
    assert page.count("no interval and no test") == 1  # one seed per arm, said once
    assert "| LayerNorm − RMSNorm | `val_loss/tail` | 1 |" in page
    learned = re.search(
        r"Final validation loss (\d\.\d{3}) nats on average over the 2 runs .* against (\d\.\d{3}) "
        r"for the validation text's unigram cross-entropy",
        page,
    )
    assert learned, page[:2000]
    finals = [
        float(r["val/loss"])
        for run in ("study-layer-s0", "study-rms-s0")
        for r in metrics_rows(out / run)
        if r.get("val/loss") and int(r["step"]) == 10
    ]
    assert float(learned.group(1)) == pytest.approx(sum(finals) / 2, abs=6e-4)
    assert "not distinguishable" not in page and " holds" not in page
    assert (
        "| study-layer-s0 |" in page.split("## Floating-point order")[1]
        and "Largest move of a run: 0.0e+00" in page
    )
    assert "The pair's difference (LayerNorm − RMSNorm, seed 0) moved by +0.0e+00 nats." in page
    assert not re.search(r"(?<![\w./])/(?!/)(tmp|work|home|root)/", page)  # no absolute path of this machine
    assert (tmp_path / "study-val_curve_diff.png").stat().st_size > 5000
    assert (tmp_path / "study-verdict.png").stat().st_size > 5000
    table = pd.read_csv(tmp_path / "study_verdict.csv")
    tail = table[(table["metric"] == "val_loss/tail") & table["primary"]]
    assert len(tail) == 1 and tail["n_seeds"].iloc[0] == 1  # one seed: the difference, no test
    assert (table["family"] == "secondary").sum() <= 6 and set(table["family"]) <= {
        "primary",
        "secondary",
        "described",
    }
