"""Issue 20, errors after Hydra starts the run and two processes in one run: everything a user can get wrong
that is known before training is checked before the run directory is claimed, a refused start leaves the
directory byte for byte as it was (or absent), and a run directory is trained by one process at a time
(normgeo/runs/start.py, normgeo/runs/lock.py; docs/reliability.md)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import normgeo.runs.start as start_checks
from corpus.__main__ import main as corpus_main
from normgeo.paths import FolderError, check_writable_folder
from normgeo.run_folder import LOCK_FILE, PLAN_FILE, REPLACED_DIR
from normgeo.runs.lock import RunInUseError, RunLock, check_unlocked
from normgeo.runs.preflight import PlanRefusal, read_kept_plan
from normgeo.runs.session import replace_diverged_run
from normgeo.runs.start import Start, put_back, survey
from tests.conftest import (
    FAST,
    ROOT,
    module_main,
    run_entry_point,
    run_train,
    step_losses,
    train_here,
    train_in_process,
)


def sha_tree(folder: Path) -> dict[str, str] | None:
    """The sha256 of every file under ``folder``, hidden ones included (None: the folder is absent)."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def assert_refused(result: subprocess.CompletedProcess, *parts: str) -> None:
    """Exit 2, and the last line of stderr is the one-line message holding every part."""
    assert result.returncode == 2, result.stderr[-3000:]
    line = last_line(result)
    assert line.startswith("error: ") and all(part in line for part in parts), result.stderr[-3000:]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder whose ``data/`` holds the prepared pydoc corpus (run_train's data_root for run dirs in it)."""
    from corpus.prepare import prepare
    from corpus.sources import PydocSource

    root = tmp_path_factory.mktemp("start")
    # conf/train/data/pydoc.yaml
    prepare(PydocSource(), root / "data" / "pydoc", val_fraction=0.05, progress=False)
    return root


# In-process: the parts.

def test_a_failed_start_is_undone_byte_for_byte(tmp_path: Path) -> None:
    """What a start does before its first optimizer step, undone from a listing (names, sizes,
    times) and the bytes of the few files it rewrites: .hydra/ rewritten, the lock's holder
    line, train.log appended, a diverged run moved aside and a CSV version written under its
    names; a killed session's temporary stays (the start's first step removes it)."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("max_steps: 3\n")
    (run_dir / LOCK_FILE).write_text('{"pid": 1}\n')
    (run_dir / "train.log").write_text("[train] done\n")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"\0" * 100)
    (run_dir / "summary.json").write_text('{"diverged": {"step": 2}}')
    (run_dir / "csv" / "version_0").mkdir(parents=True)
    (run_dir / "csv" / "version_0" / "metrics.csv").write_text("step,train/loss\n1,nan\n")
    (run_dir / ".angles.jsonl.x.normgeo-tmp").write_text("{")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}
    found = survey(run_dir)
    time.sleep(0.01)
    (run_dir / ".hydra" / "config.yaml").write_text("max_steps: 30\n")  # what a start writes
    (run_dir / LOCK_FILE).write_text('{"pid": 2, "host": "n1"}\n')
    with open(run_dir / "train.log", "a") as log:
        log.write("[train] run directory\n")
    assert replace_diverged_run(run_dir)  # checkpoints/, csv/ and summary.json moved aside
    (run_dir / "csv" / "version_0").mkdir(parents=True)  # the new session's CSV logger: the same names
    (run_dir / "csv" / "version_0" / "hparams.yaml").write_text("a: 1\n")
    put_back(run_dir, found, replaced=True)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in run_dir.iterdir()) == [".angles.jsonl.x.normgeo-tmp", ".hydra", LOCK_FILE,
                                                          "checkpoints", "csv", "summary.json", "train.log"]


def test_the_first_step_keeps_the_start_and_deletes_what_waited_for_it(tmp_path: Path) -> None:
    """Start.keep: the temporaries killed sessions left and a replaced run (here one a SIGKILLed start left
    aside) go at the first optimizer step."""
    run_dir = tmp_path / "run"
    (run_dir / REPLACED_DIR / "checkpoints").mkdir(parents=True)
    (run_dir / ".angles.jsonl.x.normgeo-tmp").write_text("{")
    (run_dir / "train.log").write_text("[train] step 1\n")
    start = Start(None, None, run_dir, None, None, None)
    start.keep()
    assert sorted(p.name for p in run_dir.iterdir()) == ["train.log"]


def test_a_fresh_start_is_undone_with_the_folders_it_created(tmp_path: Path) -> None:
    run_dir = tmp_path / "outputs" / "sweep" / "run"
    found = survey(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").write_text("x\n")
    put_back(run_dir, found)
    assert list(tmp_path.iterdir()) == []


def test_the_lock_names_its_holder_and_is_released(tmp_path: Path) -> None:
    tmp_path.joinpath("run").mkdir()
    lock = RunLock(tmp_path / "run")
    check_unlocked(tmp_path / "run")
    lock.acquire()
    try:
        holder = rf"is being trained by PID {os.getpid()} on host {re.escape(socket.gethostname())} \(since"
        with pytest.raises(RunInUseError, match=holder):  # another open file description: it conflicts
            check_unlocked(tmp_path / "run")  # like another process's
        with pytest.raises(RunInUseError, match=holder):
            RunLock(tmp_path / "run").acquire()
    finally:
        lock.release()
    check_unlocked(tmp_path / "run")
    assert (tmp_path / "run" / LOCK_FILE).is_file()  # kept: deleting a lock file races with its next taker


def test_a_run_dir_under_a_file_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(FolderError, match=r"a-file is a file, so the folder cannot be created there"):
        check_writable_folder(tmp_path / "a-file" / "outputs" / "run", "run_dir")
    check_writable_folder(tmp_path / "new" / "run", "run_dir")


# Through train.py: exit 2, one line, the run directory as it was.

@pytest.mark.slow
@pytest.mark.parametrize(("override", "parts"), [
    ("probe.tokens=100000000", ("the probe corpus has only 139,016 tokens but 100,000,000 were asked for",
                                "lower probe.tokens")),
    # probe.tokens: 2 sequences of seq_len at least (the
    # schema's cross-key rule), so that the data is what fails
    ("seq_len=10000 probe.tokens=20000", ("val.bin has", "tokens: too few for sequences of 10000")),
], ids=["probe-text-too-short", "data-too-short-for-seq_len"])
def test_a_fresh_start_refused_before_training_leaves_no_run_directory(workspace: Path, override: str,
                                                                      parts: tuple[str, ...], capsys) -> None:
    run_dir = workspace / f"fresh-{override.split('=')[0]}"
    done = train_in_process(run_dir, *override.split(), capsys=capsys)
    assert_refused(done, *parts)
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))
    # The corrected command is not refused for what the failed one left behind (before: run_config.yaml).
    if override.startswith("probe"):
        train_here(run_dir, "max_steps=1")


@pytest.mark.slow
def test_a_plan_that_cannot_fit_is_refused_before_the_claim(workspace: Path, monkeypatch, capsys) -> None:
    """Issue 51: the pre-flight plan (on a GPU: the planned peak against its memory) is a start check, made
    before the run directory is claimed: one line, exit 2, no folder (before: after the claim, and its
    refusal, not one of the start's, ended in a traceback). The GPU's verdict is stood in for here; the
    decision itself is tested in test_plan.py."""
    def refuse(cfg) -> None:
        raise PlanRefusal("micro_batch=64: the planned peak 212.3 GiB cannot fit the NVIDIA H100's 79.1 GiB")

    monkeypatch.setattr(start_checks, "preflight", refuse)
    run_dir = workspace / "too-big"
    done = train_in_process(run_dir, "max_steps=1", capsys=capsys)
    assert_refused(done, "the planned peak 212.3 GiB cannot fit")
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))


@pytest.mark.slow
def test_the_gate_refuses_through_the_device_override_before_the_claim(workspace: Path, capsys) -> None:
    """Issue 61: plan.device_memory_gib states the device, so the gate runs on the CPU too: a card below the
    plan's lower bound refuses the start, one line naming the card and the micro_batch that fits, nothing
    written."""
    run_dir = workspace / "override-too-small"
    done = train_in_process(run_dir, "max_steps=1", "plan.device_memory_gib=0.001", capsys=capsys)
    assert_refused(done, "micro_batch=4 cannot fit", "plan.device_memory_gib=0.001", "eager plan's peak",
                   "no micro_batch fits the plan")
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [(["plan.device_memory_gib=64"], ["plan.check=false"]),
                                        (["plan.check=false"], ["plan.device_memory_gib=64"])])
def test_a_run_resumes_with_the_check_turned_off_or_on(workspace: Path, first: list[str],
                                                        then: list[str]) -> None:
    """Issue 61: plan may change between sessions, so ``resume=auto plan.check=false`` continues a run
    started with the check on, and the other way round; a plan made is kept in the run folder
    (plan.json) once the start is accepted, and a later session of the same config reads it."""
    run_dir = workspace / f"resume-{first[0].split('=')[0]}"
    common = ["max_steps=4", "probe.enabled=false", "checkpoint.last_every=1"]
    train_here(run_dir, *common, *first, "stop_at_step=2")
    kept = run_dir / PLAN_FILE
    assert kept.exists() == ("plan.check=false" not in first)
    before = kept.read_bytes() if kept.exists() else None
    assert max(step_losses(run_dir)) == 2
    train_here(run_dir, *common, *then, "resume=auto")
    assert sorted(step_losses(run_dir)) == [1, 2, 3, 4]  # continued, not refused and not started over
    if before is not None:  # the check is off now: the kept plan stays as it was
        assert kept.read_bytes() == before
    else:  # the check is on now: planned once, kept, and read (not made again) by the next session
        plan = json.loads(kept.read_text())
        assert plan["plan"]["compiled"] is False and plan["inputs"]["setup"]["micro_batch"] == 4
        assert read_kept_plan(run_dir, plan["inputs_hash"]) is not None


@pytest.mark.slow
def test_a_kept_plan_of_one_trace_is_traced_again_for_a_card_it_does_not_fit(workspace: Path, capsys) -> None:
    """The gate traces a second micro_batch only where the first does not fit: a run started on a stated
    64 GiB card keeps a plan without the peak's slope; its resume on a smaller card traces again and names
    what fits, and the refused resume changes nothing."""
    run_dir = workspace / "kept-one-trace"
    common = ["max_steps=4", "probe.enabled=false", "checkpoint.last_every=1"]
    train_here(run_dir, *common, "plan.device_memory_gib=64", "stop_at_step=2")
    kept = json.loads((run_dir / PLAN_FILE).read_text())["plan"]
    assert kept["per_sample"] is None and kept["fixed"] is None and kept["peak"] > 0
    before = sha_tree(run_dir)
    done = train_in_process(run_dir, *common, "plan.device_memory_gib=0.001", "resume=auto", capsys=capsys)
    assert_refused(done, "micro_batch=4 cannot fit", "no micro_batch fits the plan")
    assert sha_tree(run_dir) == before


@pytest.mark.slow
def test_a_resume_whose_probe_text_got_shorter_is_refused_and_changes_nothing(
    workspace: Path, capsys
) -> None:
    text = workspace / "probe-text"
    text.mkdir()
    for index in range(12):
        (text / f"{index:02d}.txt").write_text(
            f"Document {index}. " + "The quick brown fox jumps over the lazy dog. " * 20
        )
    probe = ["probe=local", f"probe.path={text}", "probe.tokens=2000", "max_steps=4", "checkpoint.steps=[2]"]
    run_dir = workspace / "resumable"
    train_here(run_dir, *probe, "stop_at_step=2")
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    for path in sorted(text.iterdir())[2:]:
        path.unlink()
    before = sha_tree(run_dir)
    done = train_in_process(run_dir, *probe, "resume=auto", capsys=capsys)
    assert_refused(done, "the probe corpus has only", "but 2,000 were asked for", "lower probe.tokens")
    assert sha_tree(run_dir) == before  # before: it trained on and failed at the next probe (exit 1)


@pytest.mark.slow
def test_a_claimed_start_that_fails_before_its_first_step_is_undone(workspace: Path) -> None:
    """A logger whose folder cannot be created (under a file) fails once the loggers start, after the claim
    (.hydra/ and train.log written, the lock taken): not a user error, so its traceback stays (exit 1), and
    the undo restores every file of the resumed run; a new run's folder is removed."""
    run_dir = workspace / "undone"
    train_here(run_dir, "max_steps=4", "stop_at_step=2")
    before = sha_tree(run_dir)
    broken = ["+logger.extra._target_=lightning.pytorch.loggers.CSVLogger",
              f"+logger.extra.save_dir={workspace / 'data' / 'pydoc' / 'train.bin'}"]
    done = train_here(run_dir, "max_steps=4", "resume=auto", *broken, check=False)
    assert done.returncode == 1 and "NotADirectoryError" in done.stderr + done.stdout, done.stderr[-3000:]
    # before the undo: .hydra/ rewritten, train.log appended, csv/version_1
    assert sha_tree(run_dir) == before
    fresh = workspace / "fresh"  # beside the prepared data (data_root is the run directory's parent's data/)
    assert train_here(fresh, "max_steps=4", *broken, check=False).returncode == 1
    assert not fresh.exists()


@pytest.mark.slow
def test_no_tokenizer_files_offline_is_one_line_before_the_run_directory(workspace: Path) -> None:
    empty = workspace / "no-tiktoken"
    empty.mkdir()
    # tiktoken then downloads: through a proxy on a closed port the download fails at once (no hang).
    offline = {
        "TIKTOKEN_CACHE_DIR": str(empty),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "http_proxy": "http://127.0.0.1:9",
        "NO_PROXY": "",
        "no_proxy": "",
    }
    run_dir = workspace / "no-tokenizer"
    done = run_train(run_dir, env=offline, check=False, timeout=300)
    assert_refused(done, "could not load the tiktoken encoding 'gpt2'", f"TIKTOKEN_CACHE_DIR={empty}",
                   "Set TIKTOKEN_CACHE_DIR to a folder holding them", "or run once with internet access")
    assert not run_dir.exists() and list(empty.iterdir()) == []


def test_a_run_dir_under_a_file_exits_2_and_writes_nothing(workspace: Path, capsys) -> None:
    blocker = workspace / "a-file"
    blocker.write_text("not a folder\n")
    done = train_in_process(blocker / "run", f"data_root={workspace / 'data'}", capsys=capsys)
    assert_refused(done, f"run_dir={blocker / 'run'}: {blocker} is a file")
    assert blocker.read_text() == "not a folder\n"  # before: Hydra's mkdir crashed with a traceback (exit 1)


def train_args(run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *FAST,
        f"run_dir={run_dir}",
        f"data_root={run_dir.parent / 'data'}",
        *overrides,
    ]


@pytest.mark.slow
def test_two_processes_one_run_the_second_is_refused_and_a_killed_holder_frees_it(workspace: Path) -> None:
    from normgeo.runs.session import checkpoint_info

    run_dir = workspace / "locked"
    long_run = ("max_steps=1000000", "checkpoint.last_every=2")
    first_log = workspace / "first.stderr"  # a file, not a pipe: a full pipe would stall the first run
    with open(first_log, "w") as stderr:
        first = subprocess.Popen(
            train_args(run_dir, *long_run), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 400
        while not (run_dir / "checkpoints" / "last.ckpt").exists():
            assert first.poll() is None, first_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run wrote no last.ckpt"
            time.sleep(0.5)
        hydra_files = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        second = run_train(run_dir, *long_run, check=False)
        assert_refused(
            second, f"{run_dir} is being trained by PID {first.pid} on host {socket.gethostname()}"
        )
        # Its refusal wrote nothing: no .hydra files, train.log lines or CSV version of its own.
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
        assert sorted(p.name for p in (run_dir / "csv").iterdir()) == ["version_0"]
        assert (run_dir / "train.log").read_text().count("run directory:") == 1
        assert first.poll() is None
    finally:
        first.kill()  # SIGKILL: the kernel drops its lock
        first.wait()
    step = checkpoint_info(run_dir / "checkpoints" / "last.ckpt").step
    third = train_here(run_dir, *long_run, "resume=auto", f"stop_at_step={step + 1}")
    assert "resuming from" in third.stderr + third.stdout + (run_dir / "train.log").read_text()
    assert checkpoint_info(run_dir / "checkpoints" / "last.ckpt").step == step + 1
    assert f'"pid": {first.pid},' not in (run_dir / LOCK_FILE).read_text()


# A norm arm with a bug: its forward raises ValueError, as a shape mismatch inside torch would. Registered in
# the child process (as tests/toy_arm.py registers its arm), which then runs train.py's real entry point.
BUGGY_ARM = """
import sys
sys.path.insert(0, {root!r})
import torch
from hydra.core.config_store import ConfigStore
from torch import nn
from models.norms import NormArm, register_arm

class Buggy(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.normalized_shape, self.eps = (dim,), 1e-5
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        raise ValueError("a bug inside the model's forward")

register_arm(NormArm("buggy", Buggy, lambda dim, eps, role: {{"dim": dim}}, "rms", "buggy", "tab:red",
                     "a bug", transformer_lens_lacks="a bug"))
ConfigStore.instance().store(group="norm", name="buggy", node={{"name": "buggy", "eps": 1e-5}})
import train
sys.argv = ["train.py", *sys.argv[1:]]
train.main()
"""


def test_a_bug_inside_the_model_keeps_its_traceback_and_is_not_a_refusal(workspace: Path) -> None:
    """A ValueError from inside the model's forward is a bug, not a user's error: its traceback stays and the
    exit is 1, not the refusals' one line and exit 2; the new run's folder is removed as after any crash
    before the first optimizer step."""
    script = workspace / "buggy_arm.py"
    script.write_text(BUGGY_ARM.format(root=str(ROOT)))
    run_dir = workspace / "buggy"
    args = [*FAST, "norm=buggy", "max_steps=2", f"run_dir={run_dir}", f"data_root={workspace / 'data'}"]
    done = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback (most recent call last)" in done.stderr, done.stderr[-3000:]
    assert "ValueError: a bug inside the model's forward" in done.stderr
    assert "error: a bug inside" not in done.stderr  # not turned into a refusal's line
    assert not run_dir.exists()


def test_a_command_writes_only_into_folders_it_owns(workspace: Path, capsys) -> None:
    """One rule for train.py and analyze.py: a folder holding another command's outputs, a sweep of runs, or
    the filesystem's root is refused in one line, exit 2, before anything is written; an empty output_root (an
    unset shell variable) too. A folder of the command's own (a resume) is not refused."""
    sweep = workspace / "owned"
    run_dir = sweep / "a-run"
    train_here(run_dir, "max_steps=1", "probe.enabled=false")
    before = sha_tree(sweep)
    analysis = ["model=checkpoint", f"model.checkpoint={run_dir / 'checkpoints' / 'last.ckpt'}",
                "probe=pydoc", "probe.tokens=512", "device=cpu", "progress=false"]
    done = run_entry_point("analyze", [*analysis, f"out_dir={run_dir}"], capsys)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: out_dir={run_dir} holds a training run (train.py): nothing of this command goes there; "
        "choose another out_dir=..."), done.stderr[-2000:]
    done = train_in_process(sweep, "max_steps=1", capsys=capsys)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: run_dir={sweep} holds a sweep (1 run(s): a-run): choose a folder of its own, e.g. "
        f"run_dir={sweep}/<name>"), done.stderr[-2000:]
    done = train_in_process(Path("/"), "max_steps=1", capsys=capsys)
    assert done.returncode == 2 and "run_dir=/: the filesystem's root" in done.stderr, done.stderr[-2000:]
    done = run_entry_point("train", [*FAST, "output_root=", "max_steps=1"], capsys)
    refusal = "error: output_root=: expected a folder"
    assert done.returncode == 2 and done.stderr.strip().startswith(refusal), done.stderr[-2000:]
    assert sha_tree(sweep) == before
    # Its own folder: a run resumes into its run_dir (nothing left to train here: one line, exit 0).
    resumed = train_in_process(run_dir, "max_steps=1", "probe.enabled=false", "resume=auto", capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


@pytest.mark.slow
def test_no_command_writes_below_a_run_or_a_data_folder(workspace: Path, capfd) -> None:
    """Issue 64, class 1: the rule holds at every depth: analyze.py ``out_dir=<run>/checkpoints``,
    ``normgeo.compare --out <run>`` and ``--out <run>/checkpoints``, ``normgeo.report --out
    <run>/checkpoints``, and (variants) an export or a comparison into a prepared data folder are refused in
    one line, exit 2, nothing written; the run's own ``resume=auto`` still goes (before: analyze wrote
    angles.jsonl, .hydra/ and analyze.log among the checkpoints and the resume was refused as "holds a
    sweep"; compare wrote ~90 files into the run)."""
    run_dir = workspace / "below" / "a-run"
    train_here(run_dir, "max_steps=1")
    data = workspace / "data" / "pydoc"
    before, data_before = sha_tree(run_dir), sha_tree(data)
    analysis = ["model=checkpoint", f"model.checkpoint={run_dir / 'checkpoints' / 'last.ckpt'}",
                "probe=pydoc", "probe.tokens=512", "device=cpu", "progress=false"]
    inside = f"is inside {run_dir.resolve()}, which holds a training run (train.py): nothing of this command"
    done = run_entry_point("analyze", [*analysis, f"out_dir={run_dir / 'checkpoints'}"], capfd)
    assert_refused(done, f"out_dir={run_dir / 'checkpoints'} {inside}", f"out_dir={run_dir}-analysis")
    for out in (run_dir, run_dir / "checkpoints"):
        assert_refused(module_main(capfd, "compare", run_dir, "--out", out), f"--out={out} ")
    assert_refused(module_main(capfd, "report", run_dir, "--out", run_dir / "checkpoints"),
                   f"--out={run_dir / 'checkpoints'} {inside}")
    assert_refused(module_main(capfd, "export", run_dir, "--to", "hf", "--out", data / "hf"),
                   f"is inside {data.resolve()}, which holds prepared data (python -m corpus)")
    assert_refused(module_main(capfd, "compare", run_dir, "--out", data), f"--out={data} holds prepared data")
    # Prepared data is a folder of its own too: python -m corpus, or train.py preparing, inside a run.
    capfd.readouterr()
    assert corpus_main(["data=pydoc", f"data_root={run_dir}"]) == 2
    assert capfd.readouterr().err.strip().startswith(f"error: data.directory={run_dir / 'pydoc'} is inside")
    other = workspace / "below" / "b-run"
    done = run_entry_point("train", [*FAST, f"run_dir={other}", f"data_root={run_dir}"], capfd)
    assert_refused(done, f"data.directory={run_dir / 'pydoc'} is inside {run_dir.resolve()}")
    assert sha_tree(run_dir) == before and sha_tree(data) == data_before
    resumed = train_in_process(run_dir, "max_steps=1", "resume=auto", capsys=capfd)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_an_output_folder_under_a_file_is_one_line_for_analyze_and_export(tmp_path: Path, capfd) -> None:
    """Issue 52, class 7: analyze.py's out_dir and the export's --out under a file are refused in one line,
    exit 2, before anything is loaded (before: an OSError traceback after the model or the conversion)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = run_entry_point("analyze", ["model=smollm2-135m", f"out_dir={blocker / 'x'}", "device=cpu"], capfd)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: out_dir={blocker / 'x'}: {blocker} is a file, so the folder cannot be created there; choose "
        "another out_dir=..."), done.stderr[-2000:]
    done = module_main(capfd, "export", tmp_path / "no-run", "--to", "hf", "--out", blocker / "x")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: --out={blocker / 'x'}: {blocker} is a file, so the folder cannot be created there; choose "
        "another --out=..."), done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def read_only_mount_works() -> bool:
    """Whether this machine lets a test mount a read-only tmpfs in its own mount namespace (``unshare -m``):
    the one read-only folder that stays read-only for root, who may write into a chmod 555 folder."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt"],
                           capture_output=True, check=False) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not read_only_mount_works(), reason="no mount namespace here for a read-only filesystem")
def test_an_output_folder_on_a_read_only_filesystem_is_one_line_for_analyze_and_export(
    tmp_path: Path,
) -> None:
    """Issue 52, class 7: analyze.py's out_dir and the export's --out on a read-only filesystem (a folder
    under it, and the read-only folder itself) are refused in one line, exit 2, before anything is loaded."""
    mount = tmp_path / "read-only"
    mount.mkdir()
    export = [sys.executable, "-m", "normgeo.export", str(tmp_path / "no-run"), "--to", "hf", "--out"]
    commands = [
        [sys.executable, "analyze.py", "model=smollm2-135m", f"out_dir={mount / 'x'}", "device=cpu"],
        [*export, str(mount / "y")],
        [*export, str(mount)],
    ]
    script = f"mount -t tmpfs -o ro tmpfs {mount} && " + " ; ".join(
        " ".join(map(shlex.quote, command)) + "; echo exit=$?" for command in commands
    )
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.stdout.split() == ["exit=2"] * 3, done.stdout + done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"error: out_dir={mount / 'x'}: {mount} is not writable (permissions or a read-only filesystem); "
        "choose another out_dir=...",
        f"error: --out={mount / 'y'}: {mount} is not writable (permissions or a read-only filesystem); "
        "choose another --out=...",
        f"error: --out={mount}: {mount} is not writable (permissions or a read-only filesystem); "
        "choose another --out=...",
    ], done.stderr[-3000:]
    assert list(mount.iterdir()) == []  # the mount is gone with its namespace: nothing was written beneath
