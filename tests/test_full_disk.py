"""A run whose disk fills: train.py exits 2 with one last line on stderr that names the file it could not
write and says to free space and resume; nothing half-written is left and what was saved stays whole;
after space is freed, the printed resume=auto command continues the run.

Before: it ended on torch's ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos``
traceback (exit 1), the real cause (No space left on device) only in the middle of it, and no path.

A real full disk: the run directory is a small tmpfs (this needs root and a container that lets it mount).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from corpus.atomic import TMP_SUFFIX, DiskFullError, atomic_open, full_disk_cause
from corpus.next_sentence import TASK_NAME
from normgeo.evaluate import main as evaluate_main
from normgeo.export import main as export_main
from tests.conftest import FAST, command_here, entry_point_here, step_losses
from tests.test_export_cli import WIKIPEDIA, hand_checkpoint

MAX_STEPS = 6
# step-0000002.ckpt (weights, ~13 MB) and last.ckpt (full state, ~39 MB) fit in 60 MB; the next last.ckpt
# needs another 39 MB beside the old one (atomic write) and does not.
SETTINGS = (f"max_steps={MAX_STEPS}", "checkpoint.steps=[2]", "checkpoint.last_every=2")
DISK = "60m"


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs for a real full disk here (needs root and CAP_SYS_ADMIN): "
                    f"{done.stderr.strip()}")


def test_atomic_open_names_the_file_when_torch_save_finds_the_disk_full(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "4m")
    try:
        (disk / "kept.ckpt").write_bytes(b"old")
        with pytest.raises(DiskFullError) as caught, atomic_open(disk / "kept.ckpt", "wb") as handle:
            torch.save({"w": torch.zeros(2_000_000)}, handle)  # 8 MB: torch raises its RuntimeError
        assert str(caught.value) == f"No space left on device writing {disk / 'kept.ckpt'}"
        assert isinstance(caught.value.__cause__, RuntimeError)  # torch's, kept as the cause
        assert full_disk_cause(caught.value) is caught.value
        assert (disk / "kept.ckpt").read_bytes() == b"old" and not list(disk.glob(f"*{TMP_SUFFIX}"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_a_full_disk_exits_2_naming_the_file_and_the_run_resumes_after_freeing_space(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    run_dir = disk / "run"
    # The prepared corpus stays off the small disk: only the run fills it. Both sessions run train.py's main
    # in this process (a new interpreter's seconds of imports saved; the error is the same one line).
    args = [*FAST, f"run_dir={run_dir}", f"data_root={tmp_path / 'data'}", *SETTINGS]
    mount_tmpfs(disk, DISK)
    try:
        full = entry_point_here("train", args)
        lines = full.stderr.splitlines()
        assert full.returncode == 2, full.stderr[-6000:]
        last = lines[-1]
        ckpt = run_dir / "checkpoints" / "last.ckpt"
        assert last.startswith(f"error: No space left on device writing {ckpt} ("), last
        assert (
            "free space on that disk, then continue from last.ckpt (step 2, intact) with resume=auto: "
            in last
        )
        assert "Traceback" not in full.stderr and "inline_container" not in full.stderr
        # Nothing half-written; what was saved before is whole.
        assert not list(run_dir.rglob(f"*{TMP_SUFFIX}"))
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
            "last.ckpt",
            "step-0000002.ckpt",
        ]
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        assert state["global_step"] == 2 and "optimizer_states" in state
        assert torch.load(run_dir / "checkpoints" / "step-0000002.ckpt", map_location="cpu",
                          weights_only=True)["global_step"] == 2

        # Free space (a bigger disk), then the command the error printed continues the run.
        subprocess.run(["mount", "-o", "remount,size=200m", str(disk)], check=True)
        command = shlex.split(last.split("with resume=auto: ", 1)[1])
        resumed = command_here(command)
        assert resumed.returncode == 0, resumed.stderr[-6000:]
        assert f"resuming from {ckpt}" in resumed.stdout
        assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == MAX_STEPS
        assert set(range(3, MAX_STEPS + 1)) <= set(step_losses(run_dir))
        assert not list(run_dir.rglob(f"*{TMP_SUFFIX}"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path, capsys) -> None:
    """Issue 34: the export's weights (~6 MB) do not fit a 2 MB disk: exit 2, one line naming --out, no
    traceback, no .partial folder; before: safetensors' OSError as a traceback."""
    run = tmp_path / "run"
    hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", "rms")
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "2m")
    try:
        assert export_main([str(run), "--to", "hf", "--out", str(disk / "hf")]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"error: --out {disk / 'hf'}: the disk is full (") and err.endswith(
            "nothing was kept; free some space and run the same command again")
        assert not list(disk.iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_an_evaluation_whose_run_folder_is_full_is_one_line_and_keeps_eval_json(tmp_path: Path, shared: Path,
                                                                                  capsys) -> None:
    """Issue 34: eval.json is written after the evaluation: on a full disk, one line naming the run, exit 2,
    the earlier eval.json whole; before: a traceback after the whole evaluation."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "8m")
    try:
        run = disk / "run"
        hand_checkpoint(run / "checkpoints" / "step-0000005.ckpt", "rms")
        earlier = json.dumps({"step": 5, "tasks": {"an_earlier_task": {"acc": 0.5}}})
        (run / "eval.json").write_text(earlier)
        filler = disk / "filler"
        with open(filler, "wb") as handle:  # the rest of the disk
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        tasks = tmp_path / "tasks"
        assert (
            evaluate_main(["--make-task", str(tasks), "--corpus", str(shared / WIKIPEDIA), "--examples", "4"])
            == 0
        )
        capsys.readouterr()
        assert (
            evaluate_main([str(run), "--tasks", TASK_NAME, "--include-path", str(tasks), "--limit", "2"]) == 2
        )
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"error: {run}: the disk is full (") and err.endswith(
            "run the same command again"
        )
        assert (run / "eval.json").read_text() == earlier
    finally:
        subprocess.run(["umount", str(disk)], check=False)
