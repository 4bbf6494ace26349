"""Issue 75, class 2: train.py's own reads of a run's files (the resume, the end), the export's model card and
the wandb id go through the rule that status and compare use (normgeo.runs.summary.read_summary, the readers'
read_run_config): the file is named, the run goes on where it can, and a damaged summary is rewritten from the
run's state. Before: a ``[]`` summary crashed the resume's end with an AttributeError (and every resume after
it), a garbage run_config.yaml crashed the export, a garbage wandb id file crashed the start."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from normgeo.run_folder import RunFolder
from normgeo.runs.summary import read_summary
from tests.conftest import module_main, train_here

pytestmark = pytest.mark.slow

COMMON = ("max_steps=4", "checkpoint.steps=[2]", "checkpoint.last_every=1", "probe.enabled=false")
DAMAGES = {"a JSON list": b"[]\n", "bytes": b"\x00\xff garbage {[\n", "empty": b""}


@pytest.fixture(scope="module")
def stopped_and_finished(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("damaged")
    train_here(root / "stopped", *COMMON, "stop_at_step=2")
    train_here(root / "finished", *COMMON)
    return root / "stopped", root / "finished"


def copied(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_summary_is_named_and_rewritten_by_the_resume(
        stopped_and_finished: tuple[Path, Path], tmp_path: Path, damage: str) -> None:
    run_dir = copied(stopped_and_finished[0], tmp_path)
    summary_path = RunFolder(run_dir).summary
    summary_path.write_bytes(DAMAGES[damage])
    done = train_here(run_dir, *COMMON, "resume=auto")
    said = done.stdout + done.stderr
    assert f"{summary_path}" in said and "rewriting it from the run's state" in said, said[-3000:]
    summary = read_summary(run_dir)  # whole and of its types again
    assert (summary["step"], summary["finished"]) == (4, True)
    assert [session["steps"] for session in summary["session_log"]] == [[2, 4]]  # the lost log said so
    again = train_here(run_dir, *COMMON, "resume=auto")  # before: the same traceback at every resume
    assert "finished" in again.stdout, again.stderr[-3000:]


def test_a_finished_run_with_a_damaged_summary_is_named_and_left_finished(
        stopped_and_finished: tuple[Path, Path], tmp_path: Path) -> None:
    run_dir = copied(stopped_and_finished[1], tmp_path)
    summary_path = RunFolder(run_dir).summary
    summary_path.write_bytes(DAMAGES["a JSON list"])
    done = train_here(run_dir, *COMMON, "resume=auto")
    said = done.stdout + done.stderr
    assert f"{summary_path}" in said and "the run is finished (its checkpoint says so)" in said, said[-3000:]
    assert "Traceback" not in said


def test_a_garbage_wandb_id_is_named_and_replaced(stopped_and_finished: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    run_dir = copied(stopped_and_finished[0], tmp_path)
    id_file = RunFolder(run_dir).wandb_id
    id_file.write_bytes(b"\x00\xff not/an id\n")
    done = train_here(run_dir, *COMMON, "resume=auto", "logger=wandb")
    said = done.stdout + done.stderr
    assert f"{id_file} is damaged" in said and "logs to a new wandb run" in said, said[-3000:]
    assert id_file.read_text().strip().isalnum()  # a new id, written whole


def test_the_export_of_a_run_whose_config_is_garbage_names_it_in_the_card(
        stopped_and_finished: tuple[Path, Path], tmp_path: Path, capfd) -> None:
    run_dir = copied(stopped_and_finished[1], tmp_path)
    RunFolder(run_dir).run_config.write_bytes(b"{{{ not: [yaml\n")
    done = module_main(capfd, "export", run_dir, "--to", "hf", "--out", tmp_path / "exported")
    assert done.returncode == 0, done.stderr[-3000:]
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "## The run's config" in card and f"Not included: {RunFolder(run_dir).run_config}" in card


def test_a_run_without_its_hydra_folder_is_still_listed_by_status(stopped_and_finished: tuple[Path, Path],
                                                                   tmp_path: Path, capfd) -> None:
    """Issue 75, class 5: status found runs by .hydra/config.yaml, train.py by run_config.yaml, so a deleted
    .hydra/ hid a run from status and compare that train.py still resumed."""
    run_dir = copied(stopped_and_finished[1], tmp_path)
    shutil.rmtree(RunFolder(run_dir).hydra)
    done = module_main(capfd, "status", tmp_path)
    assert done.returncode == 0 and run_dir.name in done.stdout and "finished" in done.stdout, done.stdout


@pytest.mark.parametrize("damage", ["an empty last.ckpt", "no checkpoints", "a garbage run_config.yaml"])
def test_a_finished_run_without_its_checkpoint_or_config_is_still_finished(
        damage: str, stopped_and_finished: tuple[Path, Path], tmp_path: Path, capfd) -> None:
    """Issue 75, class 5: a finished run with an empty last.ckpt (or its checkpoints deleted to save space)
    was told to start again under another run_name; one with a damaged config showed as "running 4/?"."""
    run_dir = copied(stopped_and_finished[1], tmp_path)
    folder = RunFolder(run_dir)
    if damage == "an empty last.ckpt":
        folder.last_checkpoint.write_bytes(b"")
    elif damage == "no checkpoints":
        shutil.rmtree(folder.checkpoints)
    else:
        folder.run_config.write_bytes(b"{{{ not: [yaml\n")
    listed = module_main(capfd, "status", run_dir, "--no-slurm")
    row = next(line for line in listed.stdout.splitlines() if run_dir.name in line)
    assert "finished" in row and "4/4" in row, listed.stdout
    if damage != "a garbage run_config.yaml":
        done = train_here(run_dir, *COMMON, "resume=auto")
        assert f"{run_dir}: already finished at step 4, as its summary.json says" in done.stdout, done.stdout
        assert "Traceback" not in done.stdout + done.stderr
