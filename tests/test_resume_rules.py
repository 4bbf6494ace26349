"""Issue 27, one rule for resume on a folder (normgeo/runs/session.py): a finished run resumed again is left
byte for byte as it was (one line, exit 0); a folder with an earlier run's files but no checkpoint is refused
(exit 2, nothing touched) with the command that starts the run fresh elsewhere."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from normgeo.runs.session import RunDirectoryError, resume_checkpoint, run_traces
from tests.conftest import train_here, train_in_process
from tests.test_start_faults import assert_refused, sha_tree

SMOKE = ("experiment=smoke", "max_steps=3")


@pytest.fixture(scope="module")
def finished_smoke(tmp_path_factory) -> Path:
    """A smoke run trained to its end (3 steps, FAST sizes)."""
    run_dir = tmp_path_factory.mktemp("resume") / "smoke-layer-s0"
    train_here(run_dir, *SMOKE)
    return run_dir


def test_an_empty_or_missing_folder_starts_fresh_and_one_with_logs_is_refused(tmp_path: Path) -> None:
    assert resume_checkpoint(tmp_path / "absent", "auto") is None
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".normgeo.lock").write_text("{}")  # a lock alone is no run
    assert run_traces(tmp_path / "empty") == [] and resume_checkpoint(tmp_path / "empty", "auto") is None
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text("[train] step 2\n")
    with pytest.raises(RunDirectoryError, match=r"holds an earlier run \(train\.log\) but no checkpoint"):
        resume_checkpoint(tmp_path / "logs", "auto")


def test_in_a_launch_of_several_processes_the_log_the_other_ranks_open_is_no_earlier_run(
    tmp_path: Path, monkeypatch
) -> None:
    """srun's other tasks open train.log as they start, maybe before rank 0 checks the folder: not a trace.
    An earlier run left its .hydra/ too, and that still refuses."""
    (tmp_path / "train.log").write_text("[train] rank 1 starting\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_traces(tmp_path) == [] and resume_checkpoint(tmp_path, "auto") is None
    (tmp_path / ".hydra").mkdir()
    with pytest.raises(RunDirectoryError, match=r"holds an earlier run \(\.hydra\) but no checkpoint"):
        resume_checkpoint(tmp_path, "auto")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert run_traces(tmp_path) == [".hydra", "train.log"]  # one process: its own log is an earlier run's


@pytest.mark.slow
def test_resuming_a_finished_run_changes_no_byte(finished_smoke: Path, capsys) -> None:
    before = sha_tree(finished_smoke)
    result = train_in_process(finished_smoke, *SMOKE, "resume=auto", capsys=capsys)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines() == [
        f"{finished_smoke}: already finished at step 3; nothing to do"
    ]
    assert "Traceback" not in result.stderr
    assert sha_tree(finished_smoke) == before


@pytest.mark.slow
def test_a_folder_with_logs_but_no_checkpoint_is_refused_and_untouched(finished_smoke: Path, tmp_path: Path,
                                                                      capsys) -> None:
    run_dir = tmp_path / "smoke-layer-s0"
    shutil.copytree(finished_smoke, run_dir)
    # A run killed before its first checkpoint: no checkpoints, no summary (with its summary, a finished run
    # whose checkpoints were deleted is finished: tests/test_damaged_run_files.py).
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "summary.json").unlink()
    before = sha_tree(run_dir)
    result = train_in_process(run_dir, *SMOKE, "resume=auto", capsys=capsys)
    assert_refused(
        result, str(run_dir), "no checkpoint to resume from", f"run_dir={tmp_path / 'smoke-layer-s0-2'}"
    )
    assert "resume=auto" not in result.stderr.strip().splitlines()[-1].split("Start it fresh elsewhere:")[1]
    assert sha_tree(run_dir) == before
    assert not (tmp_path / "smoke-layer-s0-2").exists()


@pytest.mark.slow
def test_a_damaged_run_config_is_repaired_by_a_resume_and_refused_by_a_fresh_start(
    tmp_path: Path, capsys
) -> None:
    """Issue 64's walk (t-resume-config): garbage in run_config.yaml. A resume reads the config from its
    checkpoint, says the file was damaged and rewrites it from that copy; a start without a checkpoint,
    which never replaces the file, is refused in one line naming it, nothing touched."""
    run_dir = tmp_path / "smoke-layer-s0"
    train_here(run_dir, *SMOKE, "stop_at_step=2")
    config = run_dir / "run_config.yaml"
    recorded = config.read_bytes()
    config.write_bytes(b"\x00\xff garbage: [unclosed")
    result = train_in_process(run_dir, *SMOKE, "resume=auto", capsys=capsys)
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout + result.stderr
    assert "run_config.yaml is damaged" in said and "rewritten from the checkpoint's copy" in said
    assert config.read_bytes() == recorded  # the checkpoint's copy is the first session's record
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "run_config.yaml").write_text("- not\n- a mapping\n")
    before = sha_tree(fresh)
    refused = train_in_process(fresh, *SMOKE, capsys=capsys)
    assert_refused(refused, "run_config.yaml is damaged: expected a mapping of the run's keys")
    assert sha_tree(fresh) == before
