"""Issue 34: every reader of a sweep identifies a run the same way and reads every
records file the same way (through the entry points: their `main` in-process, one
real process; on copies of the real sweep of conftest ``arms_sweep``).

1. Two folders of one arm and seed (a backup copy) are refused by ``compare``, ``status``, ``report`` and the
   verdict alike: exit 2, each folder named on a line of its own, nothing written.
2. Each records file cut mid-line is named with its file and line by ``report``, ``compare`` and ``status``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from normgeo.figures.sweep import load
from normgeo.readers.identity import DuplicateRuns
from normgeo.run_folder import ANGLES_FILE, INTERVENTION_FILE, RECORD_FILES
from normgeo.verdict.families import pairings
from normgeo.verdict.measures import run_measures
from tests.conftest import ROOT, module_main
from tests.test_start_faults import sha_tree

pytestmark = pytest.mark.slow  # the trained sweep


def tool(name: str, *args: str | Path) -> subprocess.CompletedProcess:
    """``python -m normgeo.<name> <args>``: a real process."""
    return subprocess.run(
        [sys.executable, "-m", f"normgeo.{name}", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def sweep(arms_sweep, tmp_path: Path) -> Path:
    """A copy of the sweep's four trained runs (tests change it)."""
    root = tmp_path / "outputs"
    shutil.copytree(arms_sweep[0], root, ignore=shutil.ignore_patterns("compare", "wandb"))
    return root


def refused_as_duplicate(result: subprocess.CompletedProcess, *folders: Path) -> None:
    """Exit 2, no traceback, each folder alone on a line, the last line the error with the fix."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    for folder in folders:
        assert f"  {folder.resolve()}" in lines, result.stderr
    assert (
        lines[-1].startswith("error: ")
        and "duplicates of one run" in lines[-1]
        and "move all but one" in lines[-1]
    )
    assert "truth value" not in result.stderr


def as_third_arm(run: Path, folder: Path, norm: str) -> None:
    """A copy of ``run`` whose config names another norm: a third arm for the verdict to pair."""
    shutil.copytree(run, folder)
    for config in (folder / "run_config.yaml", folder / ".hydra" / "config.yaml"):
        text = config.read_text()
        assert "norm:\n  name: rms\n" in text
        config.write_text(text.replace("norm:\n  name: rms\n", f"norm:\n  name: {norm}\n"))


@pytest.mark.parametrize("third_arm", [False, True])
def test_a_backup_copy_of_a_run_is_refused_by_every_reader(sweep: Path, third_arm: bool, capfd) -> None:
    original = sweep / "tiny-layer-s0"
    backup = sweep / "backup" / "tiny-layer-s0"
    shutil.copytree(original, backup)
    if third_arm:  # before: compare ended in pandas' "The truth value of a Series is ambiguous"
        as_third_arm(sweep / "tiny-rms-s0", sweep / "third" / "tiny-rms_bias-s0", "rms_bias")
    before = sha_tree(sweep)
    # compare: before, it paired one of the two without a word (or ended in pandas' "truth value" message)
    refused_as_duplicate(tool("compare", sweep), original, backup)
    assert sha_tree(sweep) == before and not (sweep / "compare").exists()
    refused_as_duplicate(module_main(capfd, "status", sweep, "--no-slurm"), original, backup)
    refused_as_duplicate(
        module_main(capfd, "plan", "experiment=smoke", "--seeds-for", "val_loss=0.01", "--sweep", sweep),
        original,
        backup,
    )  # the verdict's SD from a sweep: the same rule
    refused_as_duplicate(
        module_main(capfd, "report", original, backup, "--out", sweep.parent / "figures"), original, backup
    )
    assert sha_tree(sweep) == before and not (sweep.parent / "figures").exists()
    # The same folder named twice is one run, not a duplicate.
    assert module_main(capfd, "report", original, original, "--out", sweep.parent / "figures").returncode == 0


def test_the_verdict_refuses_two_runs_of_one_arm_and_seed(sweep: Path) -> None:
    comparison = load([sweep])
    measures = run_measures(comparison)
    copy = measures.iloc[[0]].assign(run_dir="/elsewhere/copy", run="copy")
    with pytest.raises(DuplicateRuns, match=r"(?s)same run \(norm=\w+ placement=pre size=tiny seed=\d\).*"
                                            r"  /elsewhere/copy\n"):
        pairings(pd.concat([measures, copy], ignore_index=True))
    found, unpaired = pairings(measures)
    assert found and unpaired.empty


def cut_mid_line(path: Path) -> int:
    """Cut ``path`` in the middle of its second line (a copy cut short); the damaged line's number."""
    text = path.read_text()
    first = text.index("\n") + 1
    path.write_text(text[: first + 20])
    return 2


def check_every_reader_skips(sweep: Path, damaged_run: Path, where: str, capfd) -> None:
    """report, compare and status name ``where`` (file:line: damaged record ...) for ``damaged_run``, read the
    other runs (exit 1), and leave the damaged run byte-identical."""
    other = sweep / "tiny-layer-s1"
    before = sha_tree(damaged_run)
    # report: the run is skipped and named, the intact one drawn (before: intervention.jsonl gave a traceback)
    result = module_main(capfd, "report", damaged_run.resolve(), other, "--out", sweep.parent / "figures")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"skipped {damaged_run.resolve()}: {where}" in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 run(s) skipped for damaged records")
    result = module_main(capfd, "report", damaged_run.resolve())
    assert result.returncode == 2 and "Traceback" not in result.stderr and where in result.stderr
    # compare: the same line, the other three runs compared
    # PNGs of the angle with 1 only (a third of the overlays, no PDFs): the skipped run is the point
    result = module_main(capfd, "compare", sweep, "--formats=png", "--refs=ones")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"skipped {damaged_run.resolve()}: {where}" in result.stderr
    assert damaged_run.name not in (sweep / "compare" / "summary.md").read_text()
    # status: every run listed, the damaged one as damaged, with the same file and line
    result = module_main(capfd, "status", sweep, "--no-slurm")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"damaged {damaged_run.name}: {where}" in result.stderr
    assert sha_tree(damaged_run) == before


@pytest.mark.parametrize("name", RECORD_FILES)
def test_every_records_file_cut_short_is_named_by_every_reader(sweep: Path, name: str, capfd) -> None:
    damaged_run = sweep / "tiny-rms-s1"
    damaged = damaged_run / name
    assert damaged.is_file() and damaged.read_text().count("\n") >= 2, (
        f"the trained run has no {name} to damage"
    )
    where = f"{damaged.resolve()}:{cut_mid_line(damaged)}: damaged record ("
    check_every_reader_skips(sweep, damaged_run, where, capfd)


def damage(path: Path, kind: str) -> tuple[int, str]:
    """Damage ``path`` as a hand edit or a bad copy would; the damaged line's number and the reason named."""
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    if kind == "text for a number":
        key = next(k for k, v in record.items() if isinstance(v, float))
        record[key] = "abc"
        lines[1] = json.dumps(record)
        reason = f"'{key}' is 'abc', expected a number"
    elif kind == "an empty record":
        lines[1] = "{}"
        reason = "no 'model', 'norm', 'step': every record has 'model', 'norm', 'step'"
    else:  # an empty file
        path.write_text("")
        return 1, "no record in the file"
    path.write_text("\n".join(lines) + "\n")
    return 2, reason


@pytest.mark.parametrize(
    "name,kind",
    [
        (ANGLES_FILE, "text for a number"),
        (ANGLES_FILE, "an empty record"),
        (ANGLES_FILE, "an empty file"),
        (INTERVENTION_FILE, "text for a number"),
    ],
)
def test_a_record_that_is_not_what_a_record_holds_is_named_by_every_reader(
    sweep: Path, name: str, kind: str, capfd
) -> None:
    """Issue 52, class 5: a record read whole but wrong (text where a number belongs, ``{}``, an empty file)
    is named with its file, line and what was expected by report, compare and status, and the others are
    read (before: a pyarrow error, an IndexError, a finished run shown as failed, or nothing at all)."""
    damaged_run = sweep / "tiny-rms-s1"
    line, reason = damage(damaged_run / name, kind)
    where = f"{(damaged_run / name).resolve()}:{line}: damaged record ({reason})"
    check_every_reader_skips(sweep, damaged_run, where, capfd)
