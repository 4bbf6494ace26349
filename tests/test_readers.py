"""Issue 27, readers never crash: ``normgeo.compare``, ``normgeo.report`` and ``normgeo.status`` check their
options before writing anything, skip (and name) a run whose files are damaged, write no half comparison,
and say ``--out`` when they cannot write (through the entry points, on the real sweep of conftest
``arms_sweep``)."""

from __future__ import annotations

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
    result = module_main(capfd, "compare", sweep, "--formats=png")
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
