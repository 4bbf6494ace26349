"""Issue 75, classes 3 and 4: a run's files are checked for what the run says they hold, by the one reader
of each file (normgeo.measure.run_records, normgeo.readers.metrics_csv, normgeo.readers.identity), so that
status, compare and report name the damaged file (and line) and carry on without the run, and a resume refuses
in one line, exit 2, with the run folder as it was.

Before: an empty metrics.csv or a deleted csv/ showed the loss as "-" and compare gave its verdict without a
word; a deleted run_config.yaml made compare read Hydra's unresolved config; a deleted ellipsoid.jsonl was
refilled by a resume with the new steps only; an empty null.jsonl read as "no null directions"; duplicated
records, a probe step past max_steps, a NaN and an extra metrics row passed every reader and the resume."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from normgeo.run_folder import ELLIPSOID_FILE, ENERGY_FILE, NULL_FILE, RunFolder
from tests.conftest import module_main, train_here

pytestmark = pytest.mark.slow

# issue 75's BASE on the tests' fast model (conftest.FAST)
BASE = ("max_steps=6", "checkpoint.steps=[2,4]", "checkpoint.last_every=2", "val_every=3",
        "probe.tokens=1024", "val_sequences=2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A finished LayerNorm run, a finished RMSNorm run (compare's other arm) and a run stopped at step 3."""
    root = tmp_path_factory.mktemp("meaning")
    train_here(root / "layer", *BASE)
    train_here(root / "rms", *BASE, "norm=rms")
    train_here(root / "stopped", *BASE, "stop_at_step=3")
    return {name: root / name for name in ("layer", "rms", "stopped")}


def copied(runs: dict[str, Path], tmp_path: Path, *names: str) -> list[Path]:
    for name in names:
        shutil.copytree(runs[name], tmp_path / "runs" / name)
    return [tmp_path / "runs" / name for name in names]


def metrics_csv(run_dir: Path) -> Path:
    return RunFolder(run_dir).csv / "version_0" / "metrics.csv"


def empty(path: Path) -> None:
    path.write_text("")


def add_line(path: Path, change: Callable[[dict], dict] = dict) -> None:
    """Append a copy of ``path``'s last line, changed by ``change``."""
    rows = path.read_text().splitlines()
    path.write_text("\n".join([*rows, json.dumps(change(json.loads(rows[-1])))]) + "\n")


def a_nan(path: Path) -> None:
    rows = path.read_text().splitlines()
    rows[4] = rows[4].replace('"mean_deg": ', '"mean_deg": NaN, "was": ', 1)
    path.write_text("\n".join(rows) + "\n")


def without_step_0(path: Path) -> None:
    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                            if json.loads(line)["step"] != 0))


def a_metrics_row(path: Path, step: int) -> None:
    header = path.read_text().splitlines()[0].split(",")
    row = [str(step) if name == "step" else "0.5" if name == "train/loss" else "" for name in header]
    path.write_text(path.read_text() + ",".join(row) + "\n")


# (what the issue did, the file it damaged, how, the words that name it)
DAMAGES = {
    "empty metrics.csv": (metrics_csv, empty, ":1: damaged metrics (no row, while summary.json says the run "
                          "trained to step 6)"),
    "deleted csv": (lambda run: RunFolder(run).csv, shutil.rmtree, ":1: damaged metrics (absent, while "
                    "summary.json says the run trained to step 6)"),
    "deleted run_config.yaml": (lambda run: RunFolder(run).run_config, Path.unlink,
                                ":1: damaged record (absent, while summary.json says the run trained)"),
    "empty null.jsonl": (lambda run: RunFolder(run).record(NULL_FILE), empty,
                         ":1: damaged record (no record in the file, while angles.jsonl has 180"),
    "deleted ellipsoid.jsonl": (lambda run: RunFolder(run).record(ELLIPSOID_FILE), Path.unlink,
                                ":1: damaged record (absent, while angles.jsonl has 180"),
    "duplicated records": (lambda run: RunFolder(run).angles, add_line,
                           ":181: damaged record (the record of line 180 again"),
    "probe step 99": (lambda run: RunFolder(run).angles, lambda p: add_line(p, lambda r: {**r, "step": 99}),
                      ":181: damaged record (step 99 is past the run's last step, max_steps=6)"),
    "a NaN value": (lambda run: RunFolder(run).record(NULL_FILE), a_nan,
                    ":5: damaged record ('mean_deg' is nan, expected finite numbers"),
    "an extra metrics row": (metrics_csv, lambda p: a_metrics_row(p, 7),
                             "damaged metrics row ('train/loss' at step 7 outside the run's steps 0 to 6)"),
    # variants the issue does not name: a step logged again, a step the other files lack
    "a metrics row again": (metrics_csv, lambda p: a_metrics_row(p, 6),
                            "damaged metrics row ('train/loss' at step 6 after step 6)"),
    "energy.jsonl without a step": (lambda run: RunFolder(run).record(ENERGY_FILE), without_step_0,
                                    ":1: damaged record (records of steps 2, 4, 6, while angles.jsonl has "
                                    "steps 0, 2, 4, 6"),
}

DRAWN = ("empty metrics.csv", "probe step 99")  # a verdict from fewer runs; a step past the run drawn


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_status_compare_and_report_name_the_damaged_file(runs: dict[str, Path], tmp_path: Path, capfd,
                                                         damage: str) -> None:
    layer, rms = copied(runs, tmp_path, "layer", "rms")
    where, how, words = DAMAGES[damage]
    path = where(layer)
    how(path)
    named = f"{path}{words}" if words.startswith(":") else words

    status = module_main(capfd, "status", tmp_path / "runs", "--no-slurm", "--json")
    rows = {row["run"]: row for row in map(json.loads, status.stdout.splitlines())}
    assert status.returncode == 1 and named in (rows["layer"]["damaged"] or ""), status.stdout + status.stderr
    assert rows["rms"]["damaged"] is None and rows["layer"]["loss"] != 0.5
    assert rows["layer"]["probe_step"] != 99

    if damage not in DRAWN:  # the same reader as status's: compare's and report's figures take a minute
        return
    compare = module_main(capfd, "compare", tmp_path / "runs", "--out", tmp_path / "compare",
                          "--formats", "png")
    assert compare.returncode == 1, compare.stderr[-3000:]  # a verdict from fewer runs is never silent
    assert f"skipped {layer}" in compare.stderr and named in compare.stderr, compare.stderr[-3000:]

    report = module_main(capfd, "report", layer, rms, "--out", tmp_path / "report")
    assert report.returncode == 1 and f"skipped {layer}" in report.stderr and named in report.stderr, (
        report.stderr[-3000:])


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage", ["deleted ellipsoid.jsonl", "empty null.jsonl", "duplicated records",
                                    "probe step 99", "a NaN value", "energy.jsonl without a step"])
def test_a_resume_refuses_in_one_line_and_leaves_the_run_as_it_was(runs: dict[str, Path], tmp_path: Path,
                                                                   damage: str) -> None:
    (stopped,) = copied(runs, tmp_path, "stopped")
    where, how, words = DAMAGES[damage]
    path = where(stopped)
    how(path)
    before = tree(stopped)
    done = train_here(stopped, *BASE, "resume=auto", check=False)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and str(path) in last and "copy" in last, done.stderr[-3000:]
    assert tree(stopped) == before


def test_an_intact_resume_is_read_as_whole(runs: dict[str, Path], tmp_path: Path, capfd) -> None:
    """The checks hold a run the resume made whole: every file holds steps 0, 2, 4, 6."""
    (stopped,) = copied(runs, tmp_path, "stopped")
    train_here(stopped, *BASE, "resume=auto")
    status = module_main(capfd, "status", stopped, "--no-slurm", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["probe_step"] == 6, status.stderr
