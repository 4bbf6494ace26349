"""SIGKILL train.py at random steps, continue with resume=auto: the run must be the uninterrupted one.

No SLURM here: a kill -9 is the worst a scheduler or a node failure does. The killed session loses the
steps after its last.ckpt (written every step here) and its unflushed CSV rows; what it wrote is whole
(atomic files), and the resumed sessions recompute the lost steps bit for bit on the same process count.
The sessions no test kills (the uninterrupted reference, the final resumes) run train.py's main in the
test's process (``train_here``, the same command line); a resume on two DDP processes is a real launch.
"""

from __future__ import annotations

import csv
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from corpus.atomic import TMP_SUFFIX
from normgeo.measure.records import read_rows
from normgeo.readers.run_states import run_status
from normgeo.runs.session import RunDirectoryError, resume_checkpoint
from tests.conftest import FAST, ROOT, run_train, train_here

pytestmark = pytest.mark.slow

MAX_STEPS = 10
VAL_EVERY = 5
# Every step is a scheduled checkpoint (so the test can see progress) and refreshes last.ckpt; validation
# at steps 5 and 10 (32 batches) gives a kill time to land inside it.
COMMON = [f"max_steps={MAX_STEPS}", "checkpoint.dense_every=1", f"checkpoint.dense_until={MAX_STEPS}",
          "checkpoint.last_every=1", f"val_every={VAL_EVERY}", "val_sequences=128"]
RNG = random.Random(20261122)  # the kill points are random but the same on every test run


def all_step_losses(run_dir: Path, metric: str = "train/loss") -> dict[int, float]:
    """``metric`` per step over every CSV session (csv/version_N); a later session wins a step.

    A SIGKILLed session may have no metrics.csv at all (the CSV logger flushes every 100 steps).
    """
    versions = sorted((run_dir / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    losses: dict[int, float] = {}
    for version in versions:
        if (version / "metrics.csv").is_file():
            with open(version / "metrics.csv", newline="") as handle:
                for row in csv.DictReader(handle):
                    if row.get(metric):
                        losses[int(float(row["step"]))] = float(row[metric])
    return losses


def angle_table(run_dir: Path) -> dict[tuple, dict]:
    """angles.jsonl keyed by (step, layer, site, ref); asserts there is no duplicate record."""
    rows = read_rows(run_dir / "angles.jsonl")
    table = {(r["step"], r["layer"], r["site"], r["ref"]): r for r in rows}
    assert len(table) == len(rows), f"{run_dir}: duplicate probe records"
    return table


def ckpt_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def train_args(run_dir: Path, *overrides: str) -> list[str]:
    # Same command line as conftest.run_train, for a process the test can kill.
    return [sys.executable, str(ROOT / "train.py"), *FAST, f"run_dir={run_dir}",
            f"data_root={run_dir.parent / 'data'}", *overrides]


def kill_during(run_dir: Path, step: int, delay: float, *overrides: str) -> int:
    """Start train.py, SIGKILL it ``delay`` s after step ``step``'s checkpoint appears; the resume step."""
    marker = run_dir / "checkpoints" / f"step-{step:07d}.ckpt"
    kill_when(run_dir, lambda proc, started: marker.exists() and marker.stat().st_mtime >= started,
              f"step {step}", delay, *overrides)
    return ckpt_step(run_dir / "checkpoints" / "last.ckpt")


def kill_when(run_dir: Path, happened, what: str, delay: float, *overrides: str) -> None:
    """Start train.py, SIGKILL it ``delay`` s after ``happened(process, start time)`` holds."""
    log_path = run_dir.parent / f"{run_dir.name}-{what.replace(' ', '-')}.log"
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            train_args(run_dir, *overrides), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 300
            while not happened(proc, started):  # by this session
                assert proc.poll() is None, f"train.py ended before {what}:\n{log_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"no {what} after 300 s:\n{log_path.read_text()[-4000:]}"
                time.sleep(0.01)
            time.sleep(delay)
            assert proc.poll() is None, f"train.py finished before the kill:\n{log_path.read_text()[-3000:]}"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume_kill")  # one data/ folder for every run of this module


@pytest.fixture(scope="module")
def uninterrupted(workdir: Path) -> Path:
    run_dir = workdir / "whole"
    train_here(run_dir, *COMMON)
    return run_dir


def test_sigkill_at_random_steps_then_resume_is_bitwise_the_uninterrupted_run(
    workdir: Path, uninterrupted: Path
) -> None:
    run_dir = workdir / "killed"
    first = RNG.randrange(2, MAX_STEPS - 4)
    second = RNG.randrange(first + 2, MAX_STEPS - 1)
    resumed_from = []
    for step in (first, second):
        delay = RNG.uniform(0.0, 0.8)  # anywhere in the next step: forward, backward, a checkpoint write
        resumed_from.append(kill_during(run_dir, step, delay, *COMMON, "resume=auto"))
        print(f"killed {delay:.2f} s after step {step}'s checkpoint; last.ckpt at step {resumed_from[-1]}")
        status = run_status(run_dir, workdir, use_slurm=False, active_s=0)
        assert (status.state, status.step) == ("failed", resumed_from[-1])
    train_here(run_dir, *COMMON, "resume=auto")
    # step-k.ckpt is written just before last.ckpt: a kill in between resumes from step k-1.
    assert resumed_from[0] >= first - 1 and resumed_from[1] >= second - 1

    reference, losses = all_step_losses(uninterrupted), all_step_losses(run_dir)
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))  # the k-th update's loss at step k
    # The last session logged every step from its checkpoint on; earlier sessions died unflushed.
    assert set(range(resumed_from[-1] + 1, MAX_STEPS + 1)) <= set(losses)
    assert {step: reference[step] for step in losses} == losses  # bitwise: same floats
    assert angle_table(run_dir) == angle_table(uninterrupted)
    assert ckpt_step(run_dir / "checkpoints" / "last.ckpt") == MAX_STEPS
    assert run_status(run_dir, workdir, use_slurm=False).state == "finished"
    a = torch.load(uninterrupted / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert not list(run_dir.glob("hpc_ckpt_*.ckpt"))
    assert all_step_losses(run_dir, "val/loss") == all_step_losses(uninterrupted, "val/loss")
    assert not list(run_dir.rglob(f"*{TMP_SUFFIX}"))  # whatever a kill interrupted, nothing is left behind
    assert json.loads((run_dir / "summary.json").read_text())["sessions"] == 3  # two killed, one finished


def test_kill_during_validation_then_damaged_last_ckpt_loses_no_validation(
    workdir: Path, uninterrupted: Path
) -> None:
    """Step 5's checkpoints wait for its validation, so a kill inside it resumes from step 4 and validates
    again; last.ckpt then truncated (a full disk), resume=auto falls back to the newest full-state
    step-*.ckpt; a kill while a checkpoint is being written leaves a temporary that the next session removes.
    """
    run_dir = workdir / "killed_in_validation"
    overrides = (*COMMON, "resume=auto", "checkpoint.keep_optimizer=true")  # full-state step-*.ckpt

    def validating(proc: subprocess.Popen, started: float) -> bool:
        # The validation windows map val.bin at their first batch (corpus.stream.TokenWindows): from then
        # on the first validation, step 5's, is running; it has 31 batches to go.
        return "/val.bin" in Path(f"/proc/{proc.pid}/maps").read_text()

    kill_when(run_dir, validating, "validation 5", 0.0, *overrides)
    assert ckpt_step(run_dir / "checkpoints" / "last.ckpt") == VAL_EVERY - 1
    last = run_dir / "checkpoints" / "last.ckpt"
    with open(last, "r+b") as handle:
        handle.truncate(last.stat().st_size // 2)

    def writing_a_checkpoint(proc: subprocess.Popen, started: float) -> bool:
        return bool(list(run_dir.glob(f"checkpoints/*{TMP_SUFFIX}")))

    kill_when(run_dir, writing_a_checkpoint, "checkpoint write", 0.0, *overrides)
    orphans = list(run_dir.rglob(f"*{TMP_SUFFIX}"))
    assert orphans
    result = train_here(run_dir, *overrides, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "last.ckpt is unreadable" in output and "falling back to" in output
    assert f"removed {len(orphans)} stale temporary file(s)" in output
    assert not list(run_dir.rglob(f"*{TMP_SUFFIX}"))
    reference = all_step_losses(uninterrupted, "val/loss")
    assert sorted(reference) == [VAL_EVERY, MAX_STEPS]
    assert all_step_losses(run_dir, "val/loss") == reference  # every point, bitwise
    assert angle_table(run_dir) == angle_table(uninterrupted)


def test_resume_from_a_weights_only_checkpoint_says_what_to_do(uninterrupted: Path) -> None:
    step_ckpt = str(uninterrupted / "checkpoints" / "step-0000003.ckpt")
    with pytest.raises(RunDirectoryError, match="holds weights only .* resume=auto, or study these weights"):
        resume_checkpoint(uninterrupted, step_ckpt)


def test_sigkill_then_resume_on_two_ddp_processes_keeps_the_token_stream(
    workdir: Path, uninterrupted: Path
) -> None:
    run_dir = workdir / "one_then_two"
    step = RNG.randrange(2, MAX_STEPS - 3)
    resumed = kill_during(run_dir, step, RNG.uniform(0.0, 0.8), *COMMON, "resume=auto")
    print(f"killed the 1-process run after step {step}; resuming from step {resumed} on 2 processes")
    run_train(run_dir, *COMMON, "resume=auto", "trainer=ddp_cpu", "trainer.devices=2")  # 2 processes

    reference, losses = all_step_losses(uninterrupted), all_step_losses(run_dir)
    assert set(range(resumed + 1, MAX_STEPS + 1)) <= set(losses)
    for s, loss in losses.items():
        # Same tokens and weights; 2 ranks x 1 micro-batch
        # instead of 1 rank x 2: only summation order differs.
        assert loss == pytest.approx(reference[s], rel=1e-4), s
    ref_angles, angles = angle_table(uninterrupted), angle_table(run_dir)
    assert ref_angles.keys() == angles.keys()
    for key, row in angles.items():
        assert row["count"] == ref_angles[key]["count"]
        assert row["mean_deg"] == pytest.approx(ref_angles[key]["mean_deg"], abs=1e-3), key


def test_a_killed_sessions_time_up_to_its_last_checkpoint_counts_in_wall_s(tmp_path: Path) -> None:
    """Issue 64, class 3 (docs/training.md checked): after a SIGKILL, the resumed run's ``wall_s`` is the
    killed session's training time up to its last checkpoint (Lightning's Timer, kept in last.ckpt) plus the
    resumed session's, not the resumed session's alone; ``session_log`` lists the sessions that wrote a
    summary (the killed one wrote none)."""
    run_dir = tmp_path / "killed"
    last = run_dir / "checkpoints" / "last.ckpt"
    settings = ("max_steps=6", "checkpoint.last_every=2", "checkpoint.steps=[6]")
    proc = subprocess.Popen(train_args(run_dir, *settings), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (last.exists() and ckpt_step(last) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no last.ckpt at step 2"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    saved = torch.load(last, map_location="cpu", weights_only=True)
    trained_s = saved["callbacks"]["Timer"]["time_elapsed"]["train"]
    assert trained_s > 0
    train_here(run_dir, *settings, "resume=auto")
    summary = json.loads((run_dir / "summary.json").read_text())
    [session] = summary["session_log"]
    assert session["steps"] == [saved["global_step"], 6]
    assert summary["wall_s"] == pytest.approx(trained_s + session["wall_s"], abs=2e-3)
    assert summary["sessions"] == 2  # issue 75, class 5: the killed one counted by its CSV log (it was 1)
