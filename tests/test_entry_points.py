"""Every entry point once, in the quick tier: two real tiny arms trained here, then each command of the
README run on them as a user would (``python -m normgeo.<name>``, ``analyze.py``) through its ``main``. The
slow tests check each command in depth; these catch a command that no longer starts or reads a fresh run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from normgeo.analysis import main as analysis_main
from normgeo.evaluate import main as evaluate_main
from normgeo.pilot import main as pilot_main
from normgeo.plan import main as plan_main
from tests.conftest import ROOT, entry_point_here, module_main, train_here

ARMS = ("layer", "rms")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """The two arms of seed 0, 4 steps each, a checkpoint and a probe at step 4, in one sweep folder."""
    folder = tmp_path_factory.mktemp("entry") / "sweep"
    for norm in ARMS:
        train_here(folder / f"tiny-{norm}-s0", f"norm={norm}", "max_steps=4", "checkpoint.steps=[4]",
                   "val_every=2", "val_sequences=8")
    return folder


def test_status_compare_and_report_read_a_fresh_sweep(sweep: Path, capfd) -> None:
    status = module_main(capfd, "status", sweep, "--no-slurm")
    assert status.returncode == 0, status.stderr
    assert all(f"tiny-{norm}-s0" in status.stdout for norm in ARMS)
    compare = module_main(capfd, "compare", sweep, "--formats=png", "--refs=ones")  # one overlay per kind
    assert compare.returncode == 0, compare.stderr
    assert (sweep / "compare" / "summary.md").is_file()
    report = module_main(capfd, "report", sweep / "tiny-rms-s0")
    assert report.returncode == 0, report.stderr
    assert list((sweep / "tiny-rms-s0" / "figures").glob("*.png"))


def test_plan_prints_the_memory_of_a_config(capsys) -> None:
    assert plan_main(["size=tiny", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["counts"]["parameters"] > 0


def test_export_analyze_and_the_cross_model_summary(sweep: Path, tmp_path: Path, capfd) -> None:
    run = sweep / "tiny-rms-s0"
    exported = module_main(capfd, "export", run, "--to", "hf", "--out", tmp_path / "hf")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "config.json").is_file()
    analyzed = entry_point_here("analyze", [
        "model=checkpoint", f"model.checkpoint={run / 'checkpoints' / 'step-0000004.ckpt'}",
        "model.name=normgeo-tiny", "probe=pydoc", "probe.tokens=256", f"out_dir={tmp_path / 'analyze'}",
        "progress=false",
    ])
    assert analyzed.returncode == 0, analyzed.stderr[-3000:]
    assert analysis_main(["summary", str(tmp_path / "analyze"), "--out", str(tmp_path / "summary")]) == 0
    assert (tmp_path / "summary" / "summary.md").is_file()


def test_the_pilot_reads_the_sweep_and_evaluate_checks_its_options(sweep: Path, capsys) -> None:
    """The pilot's page of a one-seed sweep (its SDs unknown: one pair); lm-evaluation-harness' real run
    takes minutes (tests/test_export_cli.py), so evaluate is run to its option check, exit 2 in one line."""
    assert pilot_main([str(sweep)]) == 0
    page = capsys.readouterr().out
    assert "| tiny-layer-s0 | layer | 0 |" in page and "| tiny-rms-s0 | rms | 0 |" in page
    assert evaluate_main([str(sweep / "tiny-rms-s0"), "--limit", "0"]) == 2
    assert "give at least 1 example per task" in capsys.readouterr().err


def test_the_readers_start_without_lightning() -> None:
    """The commands that read runs (status, compare, report, export, the pilot) import no Lightning: its
    import alone is most of train.py's start-up (seconds), and nothing they read needs a Trainer."""
    readers = "normgeo.status", "normgeo.compare", "normgeo.report", "normgeo.export", "normgeo.pilot"
    code = f"import sys, {', '.join(readers)}; print(sorted(m for m in sys.modules if 'lightning' in m))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
