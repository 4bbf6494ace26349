"""Issue 27, readers never crash: ``normgeo.compare``, ``normgeo.report`` and ``normgeo.status`` check their
options before writing anything, skip (and name) a run whose files are damaged, write no half comparison,
and say ``--out`` when they cannot write (through the entry points, on the real sweep of conftest
``arms_sweep``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import module_main
from tests.test_start_faults import sha_tree

pytestmark = pytest.mark.slow  # the trained sweep


def one_error_line(result: subprocess.CompletedProcess, code: int, *parts: str) -> str:
    """The exit code, no traceback, and the last stderr line an ``error:`` holding every part."""
    assert result.returncode == code and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(part in last for part in parts), result.stderr[-3000:]
    return last


@pytest.fixture
def sweep(arms_sweep, tmp_path: Path) -> Path:
    """A copy of the sweep's four trained runs (tests damage it)."""
    root = tmp_path / "outputs"
    shutil.copytree(arms_sweep[0], root, ignore=shutil.ignore_patterns("compare", "wandb"))
    return root


def test_an_unknown_figure_format_is_refused_before_anything_is_written(sweep: Path, capfd) -> None:
    before = sha_tree(sweep)
    one_error_line(
        module_main(capfd, "compare", sweep, "--formats=png,xyz"),
        2,
        "--formats=png,xyz",
        "xyz is not a figure format",
        "png",
    )
    assert sha_tree(sweep) == before and not (sweep / "compare").exists()  # before: 7 files, then a traceback
    one_error_line(
        module_main(capfd, "compare", sweep, "--refs=ones,nosuch"),
        2,
        "--refs=ones,nosuch",
        "no records of nosuch",
    )
    assert sha_tree(sweep) == before


def test_a_truncated_summary_json_skips_its_run_and_names_it(sweep: Path, capfd) -> None:
    damaged = sweep / "tiny-rms-s1" / "summary.json"
    damaged.write_text(damaged.read_text()[:40])
    result = module_main(capfd, "compare", sweep, "--formats=png", "--refs=ones")
    assert f"skipped {damaged.parent}: {damaged}:" in result.stderr
    one_error_line(result, 1, "1 run(s) skipped for damaged records")
    out = sweep / "compare"
    assert (
        "tiny-rms-s1" not in (out / "summary.md").read_text()
        and "tiny-rms-s0" in (out / "summary.md").read_text()
    )
    assert (out / "verdict.md").is_file() and not [p for p in out.iterdir() if p.name.startswith(".")]
    # Every run damaged: exit 2 and no compare/ folder at all (before: a half-written one).
    for run in sweep.glob("tiny-*"):
        (run / "summary.json").write_text("{")
    shutil.rmtree(out)
    one_error_line(module_main(capfd, "compare", sweep), 2, "no readable training runs", "summary.json")
    assert not out.exists()


def test_an_unwritable_output_folder_says_out(sweep: Path, capfd) -> None:
    # /sys refuses a new folder even to root (os.access cannot tell there: the write itself is refused).
    one_error_line(
        module_main(capfd, "compare", sweep, "--out=/sys/normgeo-compare"),
        2,
        "/sys/normgeo-compare",
        "choose another --out=",
    )
    one_error_line(
        module_main(capfd, "report", sweep / "tiny-layer-s0", "--out=/sys/normgeo-report"),
        2,
        "choose another --out=",
    )


def test_report_checks_the_layer_and_skips_a_damaged_run(sweep: Path, capfd) -> None:
    before = sha_tree(sweep)
    one_error_line(
        module_main(capfd, "report", sweep / "tiny-layer-s0", "--layer=99"),
        2,
        "--layer=99: no such layer",
        "blocks 0 to 1",
        "final",
    )
    assert sha_tree(sweep) == before  # before: the figures of the last step, then a traceback
    angles = sweep / "tiny-rms-s0" / "angles.jsonl"
    angles.write_text(angles.read_text()[:-30])  # cut mid-line
    result = module_main(
        capfd, "report", sweep / "tiny-layer-s0", sweep / "tiny-rms-s0", f"--out={sweep / 'figs'}"
    )
    assert f"skipped {angles.parent}: {angles}:" in result.stderr
    one_error_line(result, 1, "1 run(s) skipped")
    assert (
        list((sweep / "figs" / "tiny-layer-s0").glob("layers_*.png"))
        and not (sweep / "figs" / "tiny-rms-s0").exists()
    )


def test_status_checks_its_options(capfd) -> None:
    one_error_line(
        module_main(capfd, "status", "--active-minutes=-1", "--no-slurm"), 2, "--active-minutes=-1.0"
    )
    one_error_line(
        module_main(capfd, "status", "--active-minutes=nan", "--no-slurm"), 2, "--active-minutes=nan"
    )


def test_every_file_of_a_run_is_read_by_one_reader_that_names_it(sweep: Path, capfd) -> None:
    """Issue 64, class 2: a summary.json with text where a number belongs and a damaged metrics.csv, through
    compare and status: each names the file, the line and what it expected, the advice fits the file, the
    other runs go on, the exit says something was skipped (before: compare aborted with "could not convert
    string to float: 'abc'" or pandas' "Error tokenizing data", status said nothing)."""
    summary = sweep / "tiny-rms-s1" / "summary.json"
    summary.write_text(summary.read_text().replace('"train_loss": ', '"train_loss": "abc", "was": ', 1))
    metrics = sweep / "tiny-layer-s1" / "csv" / "version_0" / "metrics.csv"
    metrics.write_text(metrics.read_text() + '3,"cut\n')
    result = module_main(capfd, "compare", sweep, "--formats=png", "--refs=ones")
    said = result.stderr
    assert (f"skipped {summary.parent}: {summary}:" in said and "damaged summary ('train_loss' is 'abc', "
            "expected a number or null); copy it again" in said), said[-3000:]
    assert f"skipped {metrics.parents[2]}: {metrics}:" in said and "damaged metrics row" in said, said[-3000:]
    assert "remove that line" not in said  # a one-object JSON file has no line to remove
    one_error_line(result, 1, "2 run(s) skipped for damaged records")
    assert "tiny-rms-s0" in (sweep / "compare" / "summary.md").read_text()
    status = module_main(capfd, "status", sweep, "--no-slurm", "--json")
    assert f"damaged tiny-layer-s1: {metrics}:" in status.stderr and f"{summary}:" in status.stderr
    one_error_line(status, 1, "2 run(s) with damaged records")
    rows = {row["run"]: row for row in map(json.loads, status.stdout.splitlines())}
    assert rows["tiny-layer-s1"]["loss"] is None and rows["tiny-layer-s0"]["loss"] is not None


def test_a_damaged_summary_or_an_empty_records_file_is_named_by_status_and_report(sweep: Path, capfd) -> None:
    """Issue 64, class 2: an empty summary.json, one with ``"step": "lots"`` (its checkpoints deleted) and an
    empty energy.jsonl: status shows the state as unknown with the reason (before: ``running -/3``, silent),
    report skips the run naming the file (before: silent) and compare too (before: "energy: 0 file(s)")."""
    empty, lots = sweep / "tiny-rms-s0" / "summary.json", sweep / "tiny-rms-s1" / "summary.json"
    empty.write_text("")
    lots.write_text(lots.read_text().replace('"step": 3', '"step": "lots"', 1))
    for run in (empty.parent, lots.parent):
        shutil.rmtree(run / "checkpoints")
    energy = sweep / "tiny-layer-s1" / "energy.jsonl"
    energy.write_text("")
    status = module_main(capfd, "status", sweep, "--no-slurm", "--json")
    rows = {row["run"]: row for row in map(json.loads, status.stdout.splitlines())}
    assert rows["tiny-rms-s0"]["state"] == "unknown" and rows["tiny-rms-s1"]["state"] == "unknown", rows
    assert f"{empty}:1: damaged summary (empty: no summary in it)" in status.stderr, status.stderr[-3000:]
    assert f"{lots}:" in status.stderr and "'step' is 'lots', expected a whole number" in status.stderr
    assert f"{energy}:1: damaged record (no record in the file" in status.stderr
    one_error_line(status, 1, "3 run(s) with damaged records")
    report = module_main(capfd, "report", sweep / "tiny-layer-s0", empty.parent, f"--out={sweep / 'figs'}")
    assert f"skipped {empty.parent}: {empty}:1: damaged summary" in report.stderr, report.stderr[-3000:]
    one_error_line(report, 1, "1 run(s) skipped")
    one_error_line(module_main(capfd, "report", energy.parent), 2, "no readable run")
