"""Ctrl-C (SIGINT) or SIGTERM while train.py trains: it finishes the optimizer step, saves a full-state
last.ckpt at that step, prints the resume command as its last line on stderr and exits 130 (SIGINT) or
143 (SIGTERM); the printed command continues the run, and summary.json counts both sessions.

Before: SIGINT exited 1 (Lightning's "Detected KeyboardInterrupt") and SIGTERM 0, both without saving, so
a resume restarted at the last scheduled last.ckpt, and nothing said how to continue.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import callbacks.run
from corpus.atomic import TMP_SUFFIX
from tests.conftest import FAST, ROOT, command_here, main_exit_code, metrics_rows, step_losses
from tests.test_resume_kill import ckpt_step, train_args

pytestmark = pytest.mark.slow

MAX_STEPS = 30
SCHEDULED = 3  # the only scheduled checkpoint before the end: before, the resume point after a Ctrl-C
SETTINGS = (f"max_steps={MAX_STEPS}", f"checkpoint.steps=[{SCHEDULED}]", "checkpoint.last_every=0")
STOPPED = re.compile(r"interrupt \((SIG\w+)\): stopping after step (\d+) to save last.ckpt")


def signal_after_scheduled_step(
    run_dir: Path, signum: int, *overrides: str, delay: float = 1.5, group: bool = False, again_when=None
) -> tuple[int, list[str], list[str]]:
    """Start train.py; ``delay`` s after step SCHEDULED's checkpoint appears, send ``signum`` (to the whole
    process group, as a terminal's Ctrl-C does, when ``group``); with ``again_when``, send it again once
    ``again_when()`` holds. Returns the exit code, the lines of stderr and of stdout (the log)."""
    marker = run_dir / "checkpoints" / f"step-{SCHEDULED:07d}.ckpt"
    err_path = run_dir.parent / f"{run_dir.name}-{signal.Signals(signum).name}.stderr"
    out_path = err_path.with_suffix(".stdout")
    with open(err_path, "w") as err, open(out_path, "w") as out:
        proc = subprocess.Popen(train_args(run_dir, *SETTINGS, *overrides), cwd=ROOT, stdout=out,
                                stderr=err, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                assert proc.poll() is None, (
                    f"train.py ended before step {SCHEDULED}:\n{err_path.read_text()[-4000:]}"
                )
                assert time.monotonic() < deadline, f"no step {SCHEDULED} after 300 s"
                time.sleep(0.05)
            time.sleep(delay)
            assert proc.poll() is None, "train.py finished before the signal"
            send = (lambda: os.killpg(proc.pid, signum)) if group else (lambda: proc.send_signal(signum))
            send()
            if again_when is not None:
                while not again_when() and proc.poll() is None:
                    time.sleep(0.002)
                send()
            proc.wait(timeout=300)  # no hang, on any rank
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, err_path.read_text().splitlines(), out_path.read_text().splitlines()


def stop_steps(lines: list[str]) -> list[int]:
    """The step each rank logged that it stops after."""
    return [int(m.group(2)) for line in lines if (m := STOPPED.search(line))]


def check_interrupted(
    run_dir: Path, outcome: tuple[int, list[str], list[str]], signum: int, ranks: int = 1
) -> tuple[int, list[str]]:
    """The interrupted session's outcome; returns the step it stopped after and the printed command."""
    code, lines, log = outcome
    name = signal.Signals(signum).name
    assert code == 128 + signum, "\n".join(lines[-40:])
    steps = stop_steps(log)
    assert len(steps) == ranks and len(set(steps)) == 1, log[-40:]  # every rank stops after the same step
    stopped = steps[0]
    assert SCHEDULED < stopped < MAX_STEPS
    last = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["global_step"] == stopped and "optimizer_states" in state  # full state, at the stop step
    assert max(step_losses(run_dir)) == stopped  # the last optimizer step logged is the one saved
    assert not list(run_dir.rglob(f"*{TMP_SUFFIX}"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["step"], summary["finished"], summary["sessions"]) == (stopped, False, 1)
    assert summary["session_log"] == [{"steps": [0, stopped], "wall_s": summary["wall_s"],
                                       "ended": f"interrupted by {name}"}]
    assert lines[-2].startswith(f"interrupted by {name}: stopped after step {stopped} and saved {last}")
    command = shlex.split(lines[-1])  # the last line is the command, ready for a shell
    assert command[-2:] == [f"run_dir={run_dir}", "resume=auto"], lines[-1]
    return stopped, command


def test_ctrl_c_saves_the_current_step_and_the_printed_command_resumes_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stopped, command = check_interrupted(  # the end's figures drawn by the resumed session
        run_dir, signal_after_scheduled_step(run_dir, signal.SIGINT, "probe.figures=true"), signal.SIGINT
    )

    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    trained_s = saved["callbacks"]["Timer"]["time_elapsed"]["train"]  # Lightning's Timer, at the save
    resumed = command_here(command)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in resumed.stdout
    assert ckpt_step(run_dir / "checkpoints" / "last.ckpt") == MAX_STEPS
    assert set(step_losses(run_dir)) == set(range(1, MAX_STEPS + 1))
    # the resumed session's log
    with open(run_dir / "csv" / "version_1" / "metrics.csv", newline="") as handle:
        trained = [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]
    assert min(trained) == stopped + 1  # it continued from the interrupted step, not from step SCHEDULED
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["step"], summary["finished"], summary["sessions"]) == (MAX_STEPS, True, 2)
    log = summary["session_log"]
    assert [s["steps"] for s in log] == [[0, stopped], [stopped, MAX_STEPS]]
    assert [s["ended"] for s in log] == ["interrupted by SIGINT", "finished"]
    # The run's time: the first session's up to its checkpoint (restored from it), then the second's.
    assert 0 < trained_s <= log[0]["wall_s"] and log[1]["wall_s"] > 0
    assert summary["wall_s"] == pytest.approx(trained_s + log[1]["wall_s"], abs=2e-3)
    assert summary["figures"] and not list(run_dir.rglob(f"*{TMP_SUFFIX}"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1])
def test_sigterm_sighup_and_sigusr1_save_the_current_step_and_exit_128_plus_the_signal(
        tmp_path: Path, signum: int) -> None:
    """Issue 75, class 8: a closed terminal's SIGHUP and a SIGUSR1 outside SLURM are stop signals,
    like SIGTERM; before: the run died where it stood (exit 129, 138), with no word and no last.ckpt."""
    run_dir = tmp_path / "run"
    check_interrupted(run_dir, signal_after_scheduled_step(run_dir, signum), signum)


def test_a_second_ctrl_c_during_the_save_stops_at_once_and_corrupts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    def saving() -> bool:
        return bool(list((run_dir / "checkpoints").glob(f".last.ckpt.*{TMP_SUFFIX}")))

    code, lines, log = signal_after_scheduled_step(run_dir, signal.SIGINT, again_when=saving)
    assert code == 130, "\n".join(lines[-40:])
    assert "SIGINT again: stopping now" in "\n".join(lines)
    command = shlex.split(lines[-1])
    assert command[-2:] == [f"run_dir={run_dir}", "resume=auto"], lines[-1]
    # The abandoned write left nothing; last.ckpt is the previous one or the new one, whole either way.
    assert not list(run_dir.rglob(f"*{TMP_SUFFIX}"))
    assert ckpt_step(run_dir / "checkpoints" / "last.ckpt") in {SCHEDULED, *stop_steps(log)}


def test_ctrl_c_on_two_ddp_processes_stops_both_after_the_same_step(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches every rank (the process group); the ranks agree on the step."""
    run_dir = tmp_path / "run"
    outcome = signal_after_scheduled_step(
        run_dir, signal.SIGINT, "trainer=ddp_cpu", "trainer.devices=2", group=True
    )
    check_interrupted(run_dir, outcome, signal.SIGINT, ranks=2)
    # rank 1 exits 0: a child's non-zero code makes Lightning's observer SIGKILL rank 0 (CI saw -9)
    assert not [line for line in outcome[1] if "terminated with code" in line]


def test_sigterm_during_a_long_validation_is_honoured_within_10_s(tmp_path: Path) -> None:
    """Issue 27: a validation of 100,000 sequences (minutes) ignored SIGTERM until it ended (a validation can
    now ask for no more sequences than its split has windows, so this one is long by its batch of one). Now
    the signal abandons it at once (its result is not logged), last.ckpt is saved at the step it followed, and
    the printed command continues the run to its end."""
    run_dir = tmp_path / "run"
    # 4,000 validation windows one at a time (the most the pydoc split's ~5,000 tokens allow,
    # with room to spare for another CPython's docs): thousands of forward passes, tens of
    # seconds. No probe: at step 5 it would come before the validation and make the test longer.
    settings = ("max_steps=8", "val_every=5", "val_sequences=4000", "micro_batch=1", "checkpoint.steps=[5]",
                "checkpoint.last_every=1", "probe.enabled=false")
    last = run_dir / "checkpoints" / "last.ckpt"
    err_path = tmp_path / "validation.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            train_args(run_dir, *settings),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            # The validation windows map val.bin at their first batch (corpus.stream.TokenWindows):
            # from then on step 5's validation, the run's first, is running. A fixed wait after
            # step 4 was not enough on a loaded machine: the signal landed in step 5's training.
            maps = Path(f"/proc/{proc.pid}/maps")
            while "/val.bin" not in maps.read_text():
                assert proc.poll() is None, err_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "no validation after 300 s"
                time.sleep(0.05)
            time.sleep(0.5)
            assert proc.poll() is None and ckpt_step(last) == 4, "the validation after step 5 is not running"
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    lines = err_path.read_text().splitlines()
    print(f"SIGTERM during validation: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 143, "\n".join(lines[-30:])
    assert took < 10.0
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["global_step"] == 5 and "optimizer_states" in state
    # the scheduled one, as the step's end would
    assert (run_dir / "checkpoints" / "step-0000005.ckpt").is_file()
    assert lines[-2].startswith(
        f"interrupted by SIGTERM: stopped after step 5 (abandoned the validation after "
        f"step 5) and saved {last}"
    )
    # the abandoned validation: not logged
    assert not any(row.get("val/loss") for row in metrics_rows(run_dir))
    command = shlex.split(lines[-1])
    assert command[-2:] == [f"run_dir={run_dir}", "resume=auto"]
    assert not list(run_dir.rglob(f"*{TMP_SUFFIX}"))
    # The command continues from step 5 to the end (the abandoned validation is not repeated: no validation
    # is due before max_steps, so the resume takes seconds, not the minutes of a validation).
    resumed = command_here(command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ckpt_step(last) == 8
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["steps"] for s in summary["session_log"]] == [[0, 5], [5, 8]]


def test_sigterm_during_a_probe_abandons_it_and_the_resume_measures_that_step(tmp_path: Path) -> None:
    """Issue 27: the probe at a scheduled step (here 8,192 tokens, seconds) is abandoned on SIGTERM within
    seconds; last.ckpt and the scheduled checkpoint are saved at the step, and the resumed session probes that
    step first (the same weights), so that angles.jsonl has every scheduled step."""
    from normgeo.measure.records import recorded_steps

    run_dir = tmp_path / "run"
    # A long probe of the angles alone (the intervention's extra forwards would only make its resume slower):
    # ~5 s on an idle core, where the signal comes within a second of the probe's start. Each session probes
    # it twice or more (steps 0 and 5; 5 and 7), so its length is most of the test's time.
    settings = ("max_steps=7", "checkpoint.steps=[5]", "checkpoint.last_every=1", "probe.tokens=8192",
                "probe.intervention=[]")
    last = run_dir / "checkpoints" / "last.ckpt"
    err_path = tmp_path / "probe.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            train_args(run_dir, *settings),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            while not (last.exists() and ckpt_step(last) == 4):  # step 5 trains next, then its probe
                assert proc.poll() is None, err_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "no step 4 after 300 s"
                time.sleep(0.02)
            time.sleep(1.0)
            assert proc.poll() is None and ckpt_step(last) == 4, "the probe at step 5 is not running"
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    lines = err_path.read_text().splitlines()
    print(f"SIGTERM during the probe: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 143 and took < 10.0, "\n".join(lines[-30:])
    assert "(abandoned the probe at step 5)" in lines[-2]
    assert ckpt_step(last) == 5 and (run_dir / "checkpoints" / "step-0000005.ckpt").is_file()
    assert 5 not in recorded_steps(run_dir / "angles.jsonl")
    resumed = command_here(shlex.split(lines[-1]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(recorded_steps(run_dir / "angles.jsonl")) == [0, 5, 7]


def test_sigterm_while_the_end_is_written_leaves_a_run_that_resume_auto_completes(tmp_path: Path) -> None:
    """Issue 52, class 1: a SIGTERM after the last step, while the summary and figures are written, says that
    every step is trained; the summary is already there (steps, loss, wall time), and resume=auto draws the
    figures without retraining anything."""
    run_dir = tmp_path / "end"
    summary = run_dir / "summary.json"
    args = train_args(run_dir, "max_steps=2", "checkpoint.steps=[2]", "probe.figures=true")
    with open(tmp_path / "end.stderr", "w") as err:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while not summary.exists():  # written first at the end: the figures come after it
            assert proc.poll() is None, (tmp_path / "end.stderr").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    stderr = (tmp_path / "end.stderr").read_text()
    said = ("SIGTERM after training, while the summary and figures were written: stopped, nothing "
            "half-written left; the trained steps are checkpointed;")
    assert said in stderr and "resume=auto" in stderr, stderr[-3000:]
    assert "nothing was trained" not in stderr
    written = json.loads(summary.read_text())
    assert written["finished"] is True and written["step"] == 2 and written["wall_s"] > 0
    assert written["figures"] == []
    checkpoints = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    rows = metrics_rows(run_dir)
    done = command_here([*args, "resume=auto"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "its end was interrupted before the figures: drawing them (nothing is retrained)" in done.stdout
    completed = json.loads(summary.read_text())
    assert completed["figures"] and all(Path(f).is_file() for f in completed["figures"])
    assert {**completed, "figures": []} == written
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == checkpoints
    assert metrics_rows(run_dir) == rows
    # Complete now: the same command says so and changes nothing.
    again = command_here([*args, "resume=auto"])
    assert again.returncode == 0 and "drawing them" not in again.stdout and "already finished" in again.stdout


# A probe of seconds at step 0 (the interruptions below land in it), the intervention's forwards left out.
LONG_PROBE = ("max_steps=2", "checkpoint.steps=[2]", "probe.tokens=16384", "probe.intervention=[]")


def interrupt_twice_in_the_first_probe(run_dir: Path, signum: int) -> tuple[int, list[str]]:
    """Start train.py and, 1.5 s after its run config is saved (fit starts next: the step-0 probe), send
    ``signum`` twice, 0.05 s apart: the exit code and the lines of stderr."""
    err_path = run_dir.parent / f"{run_dir.name}-twice.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(train_args(run_dir, *LONG_PROBE), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not (run_dir / "run_config.yaml").is_file():
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-4000:]
                time.sleep(0.02)
            time.sleep(1.5)
            for _ in range(2):
                proc.send_signal(signum)
                time.sleep(0.05)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, err_path.read_text().splitlines()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_command_printed_after_two_signals_before_the_first_last_ckpt_is_accepted(
        tmp_path: Path, signum: int) -> None:
    """Issue 64, class 4: two Ctrl-C (or, a variant, two SIGTERM) in a new run's step-0 probe, before any
    last.ckpt: the printed command is one train.py accepts (the run's own command: nothing to resume), and it
    trains the run to its end; before: "continue with: ... resume=auto", refused ("no checkpoint to resume
    from")."""
    run_dir = tmp_path / "run"
    code, lines = interrupt_twice_in_the_first_probe(run_dir, signum)
    assert code == 128 + signum, "\n".join(lines[-30:])
    # Class 6: a session that trained nothing saved nothing (before: a last.ckpt of step 0, 4 GB for size=1b),
    # and its start is undone: the new run's folder is gone.
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))
    if lines[-1].endswith("nothing was trained; run the same command again"):  # the second signal after fit
        command = train_args(run_dir, *LONG_PROBE)
    else:
        command = shlex.split(lines[-1])
        assert command[-1] == f"run_dir={run_dir}" and "resume=auto" not in command, lines[-3:]
    assert "Traceback" not in "\n".join(lines), "\n".join(lines[-30:])
    done = command_here(command)
    assert done.returncode == 0, done.stderr[-4000:]
    assert ckpt_step(run_dir / "checkpoints" / "last.ckpt") == 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_as_fit_ends_stops_the_end_and_says_so(tmp_path: Path, signum: int) -> None:
    """Issue 64, class 3: SIGINT or SIGTERM just after Lightning's "`Trainer.fit` stopped" (the last step's
    poll is past): the summary is written (its session ``interrupted by ...``), the figures are left, one line
    says so with the command that draws them, and the exit is 128 + the signal; the command completes the run
    without retraining; before: the figures drawn and exit 0 (SIGTERM: after a "finishing this optimizer step"
    line), with nothing in the summary saying the session was interrupted."""
    run_dir = tmp_path / "end"
    args = train_args(run_dir, "max_steps=2", "checkpoint.steps=[2]", "probe.figures=true")
    err_path = tmp_path / "end.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while "`Trainer.fit` stopped" not in err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-4000:]
            time.sleep(0.001)
        proc.send_signal(signum)
        code = proc.wait(timeout=120)
    lines = err_path.read_text().splitlines()
    name = signal.Signals(signum).name
    assert code == 128 + signum, "\n".join(lines[-20:])
    said = f"{name} after training, while the summary and figures were written: stopped"
    assert lines[-1].startswith(said), lines[-3:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] is True and summary["figures"] == []
    assert summary["session_log"][-1]["ended"] == f"interrupted by {name}"
    command = lines[-1].split("checkpointed; ", 1)[1].split(" writes the rest", 1)[0]
    done = command_here(shlex.split(command))
    assert done.returncode == 0 and "drawing them (nothing is retrained)" in done.stdout, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["figures"]


@pytest.mark.parametrize("moment", ["the summary write", "after the summary", "the figures"])
def test_a_signal_at_any_moment_of_the_end_is_recorded_in_the_summary(
        tmp_path: Path, capfd, monkeypatch, moment: str) -> None:
    """Issue 75, class 8: the end records what it did whenever a signal lands in it, delivered here at each
    moment on purpose (in the test's process, so the timing is the code's, not the machine's load): the
    summary's session says "interrupted by SIGTERM", the figures are left to the printed command, exit 143.
    Before: a signal after the summary was written exited 143 while the summary said "finished"."""
    def signal_around(function, before: bool):
        def wrapped(*args, **kwargs):
            if before:
                os.kill(os.getpid(), signal.SIGTERM)
            result = function(*args, **kwargs)
            if not before:
                os.kill(os.getpid(), signal.SIGTERM)
            return result
        return wrapped

    calls = {"write_summary": 0}
    real_write = callbacks.run.write_summary

    def first_write(*args, **kwargs):  # only the end's first summary (end_interrupted writes one too)
        calls["write_summary"] += 1
        if calls["write_summary"] > 1:
            return real_write(*args, **kwargs)
        return signal_around(real_write, before=moment == "the summary write")(*args, **kwargs)

    if moment == "the figures":
        drawn = signal_around(callbacks.run.draw_figures, before=True)
        monkeypatch.setattr(callbacks.run, "draw_figures", drawn)
    else:
        monkeypatch.setattr(callbacks.run, "write_summary", first_write)
    run_dir = tmp_path / "end"
    capfd.readouterr()
    code = main_exit_code("train", [*FAST, f"run_dir={run_dir}", f"data_root={tmp_path / 'data'}",
                                    "max_steps=2", "checkpoint.steps=[2]", "probe.figures=true"])
    lines = capfd.readouterr().err.splitlines()
    assert code == 128 + signal.SIGTERM, lines[-20:]
    assert lines[-1].startswith("SIGTERM after training, while the summary and figures were written: stopped")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] is True and summary["figures"] == []
    assert summary["session_log"][-1]["ended"] == "interrupted by SIGTERM"
