"""On a real one-node SLURM (../shared/slurm/slurm-local.sh,
as root): ``pytest -m slurm tests/test_slurm.py``.

slurm/train.sbatch with 2 CPU tasks (DDP over gloo) runs to the end; the same job interrupted by
``scancel --signal=USR1``, by preemption from the ``urgent`` partition, or by USR1 during start-up
requeues itself (Restarts=1) and ends with the uninterrupted job's losses and probe records, bit for bit;
a 2-run Hydra sweep goes through the submitit launcher (conf/hydra/launcher/slurm.yaml), each job with its
own size's resources.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, SHARED
from tests.test_resume_kill import all_step_losses, angle_table, ckpt_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = SHARED / "slurm" / "slurm-local.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"
CPU_TASKS = ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1"]  # override the GPU lines
MAX_STEPS = 16  # enough steps after the trigger at step 2 that a preemption lands mid-training
DDP = [o for o in FAST if not o.startswith("trainer=")] + [
    "trainer=ddp",  # the paper's trainer: num_nodes from SLURM_NNODES (a string in the environment)
    "trainer.accelerator=cpu",  # no GPU here: gloo instead of NCCL, everything else as on a cluster
    "trainer.devices=2",  # = --ntasks-per-node (Lightning checks)
    f"max_steps={MAX_STEPS}",
    "checkpoint.steps=[2,8]",
    "checkpoint.last_every=1000",  # so a requeue resumes from the last.ckpt written when it stopped
    "probe.figures=true",  # the end's figures, as a user's job draws them
]
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
USR1_CAUGHT = 1 << (10 - 1)  # SIGUSR1 = 10: its bit in /proc/<pid>/status SigCgt
RNG = random.Random(7)
# CSV for the losses plus offline wandb, to check that a requeued run keeps its wandb id.
CSV_WANDB = """\
csv:
  _target_: lightning.pytorch.loggers.CSVLogger
  save_dir: ${run_dir}
  name: csv
wandb:
  _target_: lightning.pytorch.loggers.WandbLogger
  project: normgeo-test
  name: ${run_name}
  save_dir: ${run_dir}
"""


def sh(*args: str, timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}): {result.stdout}{result.stderr}")
    return result


@pytest.fixture(scope="session")
def cluster() -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurm-local.sh starts slurmctld/slurmd/munged)")
    if not SCRIPT.is_file():
        pytest.skip(f"{SCRIPT} is missing (set NORMGEO_SHARED to the shared folder)")
    try:
        # The node advertises this machine's cores: slurm-local.sh counts them with nproc, which reads
        # the one OpenMP thread the tests run with (conftest.py) as one core.
        env = {**os.environ, "SLURM_LOCAL_CPUS": os.environ.get("SLURM_LOCAL_CPUS", str(os.cpu_count()))}
        up = sh("bash", str(SCRIPT), "up", timeout=900, check=False, env=env)
    except subprocess.TimeoutExpired:
        pytest.skip("slurm-local.sh up did not finish in 15 min")
    if up.returncode:
        pytest.skip(f"slurm-local.sh up failed ({up.returncode}):\n{(up.stdout + up.stderr)[-2000:]}")
    ours = "already up" not in up.stderr  # leave a cluster someone else started running
    yield
    if ours:
        sh("bash", str(SCRIPT), "down", timeout=300, check=False)


@pytest.fixture(scope="module")
def workdir(cluster, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("slurm")
    (work / "logs").mkdir()  # SLURM does not create the folder of --output
    (work / "conf" / "logger").mkdir(parents=True)
    (work / "conf" / "logger" / "csv_wandb.yaml").write_text(CSV_WANDB)
    return work


class Job:
    """One sbatch of slurm/train.sbatch: id, log, and waits that fail with the log attached."""

    def __init__(self, workdir: Path, name: str, *overrides: str, steps: int = MAX_STEPS) -> None:
        self.run_dir = workdir / name
        command = ["sbatch", "--parsable", *CPU_TASKS, f"--job-name=ng-{name}",
                   f"--output={workdir}/logs/%x-%j.out", str(SBATCH), *DDP, f"max_steps={steps}",
                   # checkpoint steps beyond max_steps are refused:
                   # a shorter job (3 to 7 steps) ends at its own
                   *([] if steps >= 8 else [f"checkpoint.steps=[2,{steps}]"]),
                   f"run_dir={self.run_dir}", f"data_root={workdir / 'data'}", *overrides]
        env = {**os.environ, "NORMGEO_PYTHON": sys.executable}
        self.id = sh(*command, cwd=ROOT, env=env).stdout.strip().split(";")[0]
        self.log = workdir / "logs" / f"ng-{name}-{self.id}.out"
        self.submitted = time.monotonic()

    def info(self) -> dict[str, str]:
        out = sh("scontrol", "-o", "show", "job", self.id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def explain(self, what: str) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log yet)"
        info = " ".join(
            f"{k}={v}" for k, v in self.info().items() if k in ("JobState", "Reason", "Restarts", "ExitCode")
        )
        return f"job {self.id}: {what}; {info}\n--- {self.log} ---\n{text[-6000:]}"

    def wait_for(self, path: Path, timeout: float = 180) -> float:
        deadline = time.monotonic() + timeout
        while not path.exists():
            state = self.info()["JobState"]
            assert state not in TERMINAL, self.explain(f"ended ({state}) before {path.name} appeared")
            assert time.monotonic() < deadline, self.explain(f"no {path.name} after {timeout} s")
            time.sleep(0.2)
        return time.monotonic() - self.submitted

    def wait_done(self, timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (info := self.info())["JobState"] not in TERMINAL:
            assert time.monotonic() < deadline, self.explain(f"not finished after {timeout} s")
            time.sleep(1)
        assert info["JobState"] == "COMPLETED", self.explain("did not complete")
        print(f"job {self.id} ({self.run_dir.name}): {info['JobState']} Restarts={info['Restarts']} "
              f"after {time.monotonic() - self.submitted:.0f} s")
        return info

    def stopped_at(self) -> int:
        found = re.findall(r"stopping after step (\d+) to save last.ckpt", self.log.read_text())
        assert found, self.explain("the log does not say where training stopped for the requeue")
        return int(found[0])


def assert_same_run(run_dir: Path, reference: Path) -> None:
    losses, expected = all_step_losses(run_dir), all_step_losses(reference)
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))
    assert losses == expected  # every step, bitwise (same 2 processes; probing does not touch training)
    assert angle_table(run_dir) == angle_table(reference)
    assert ckpt_step(run_dir / "checkpoints" / "last.ckpt") == MAX_STEPS
    assert not list(run_dir.glob("hpc_ckpt_*.ckpt"))  # Lightning's own requeue path stays off
    assert len(list((run_dir / "csv").glob("version_*"))) == 2  # one CSV session per SLURM run


@pytest.fixture(scope="module")
def reference(workdir: Path) -> Path:
    job = Job(workdir, "uninterrupted")
    info = job.wait_done()
    assert info["Restarts"] == "0", job.explain("restarted")
    return job.run_dir


def test_sbatch_ddp_job_leaves_checkpoints_probes_and_figures(reference: Path) -> None:
    checkpoints = sorted(p.name for p in (reference / "checkpoints").iterdir())
    # The final step is always on the schedule.
    assert checkpoints == [
        "last.ckpt",
        "step-0000002.ckpt",
        "step-0000008.ckpt",
        f"step-{MAX_STEPS:07d}.ckpt",
    ]
    assert sorted({key[0] for key in angle_table(reference)}) == [0, 2, 8, MAX_STEPS]
    assert any((reference / "figures").glob("layers_*.png"))
    assert all_step_losses(reference).keys() == set(range(1, MAX_STEPS + 1))
    assert len((reference / "slurm_jobs.tsv").read_text().splitlines()) == 1


def test_usr1_mid_training_requeues_and_resumes_exactly(workdir: Path, reference: Path) -> None:
    job = Job(workdir, "usr1")
    waited = job.wait_for(job.run_dir / "checkpoints" / "step-0000002.ckpt")
    time.sleep(RNG.uniform(0, 0.5))
    sh("scancel", "--signal=USR1", job.id)  # no --batch: SLURM signals the job step, i.e. the ranks
    info = job.wait_done()
    print(f"USR1 sent {waited:.0f} s after submission; training stopped after step {job.stopped_at()}")
    assert info["Restarts"] == "1", job.explain("expected exactly one requeue")
    assert 2 <= job.stopped_at() < MAX_STEPS
    assert_same_run(job.run_dir, reference)
    sessions = (job.run_dir / "slurm_jobs.tsv").read_text().splitlines()
    assert [line.split("\t")[:2] for line in sessions] == [[job.id, "0"], [job.id, "1"]]


def test_preemption_by_the_urgent_partition_requeues_and_resumes_exactly(
    workdir: Path, reference: Path
) -> None:
    # Offline wandb next to the CSV logger (probe tables included), to check the requeued session continues
    # the same wandb run.
    job = Job(workdir, "preempted", f"hydra.searchpath=[file://{workdir / 'conf'}]", "logger=csv_wandb")
    waited = job.wait_for(job.run_dir / "checkpoints" / "step-0000002.ckpt")
    # Both CPUs of the node: SLURM must preempt (requeue) the debug job to run this one.
    urgent = sh("sbatch", "--parsable", "-p", "urgent", "-n", "2", f"--output={workdir}/logs/urgent-%j.out",
                "--wrap", "sleep 1").stdout.strip()
    info = job.wait_done()
    print(f"urgent job {urgent} submitted {waited:.0f} s after the training job; "
          f"training stopped after step {job.stopped_at()}")
    assert info["Restarts"] == "1", job.explain("expected exactly one requeue")
    assert "COMPLETED" in sh("scontrol", "-o", "show", "job", urgent).stdout
    assert_same_run(job.run_dir, reference)
    run_id = (job.run_dir / "wandb_run_id.txt").read_text().strip()
    offline = sorted(p.name for p in (job.run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline), offline


def rank_pids(job: Job) -> list[int]:
    """PIDs of the job step's tasks (scontrol listpids: LOCALID is a number for a task's own process)."""
    out = sh("scontrol", "listpids", job.id, check=False).stdout.splitlines()[1:]
    return [
        int(cols[0])
        for cols in map(str.split, out)
        if len(cols) == 5 and cols[2] == "0" and cols[3].isdigit()
    ]


def catches_usr1(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
    return bool(caught and int(caught.group(1), 16) & USR1_CAUGHT)


def test_usr1_during_start_up_requeues_the_job(workdir: Path) -> None:
    job = Job(workdir, "early", steps=4)
    deadline = time.monotonic() + 120
    while not ((pids := rank_pids(job)) and len(pids) == 2 and all(map(catches_usr1, pids))):
        assert time.monotonic() < deadline, job.explain("the ranks never installed their USR1 handler")
        assert job.info()["JobState"] not in TERMINAL, job.explain("ended before the signal")
        time.sleep(0.05)
    assert not (job.run_dir / "checkpoints").exists()  # still importing: training has not started
    sh("scancel", "--signal=USR1", job.id)
    print(f"USR1 sent {time.monotonic() - job.submitted:.1f} s after submission, before training started")
    info = job.wait_done()
    assert info["Restarts"] == "1", job.explain("expected exactly one requeue")
    assert "USR1 before training started" in job.log.read_text()
    assert ckpt_step(job.run_dir / "checkpoints" / "last.ckpt") == 4


def test_sweep_through_the_submitit_launcher_gives_each_run_its_sizes_resources(workdir: Path) -> None:
    """Two sizes with different time limits: each job's sbatch script carries its own size's --time."""
    sweep = workdir / "sweep"
    sizes = workdir / "conf" / "size"
    sizes.mkdir(parents=True, exist_ok=True)
    for name, minutes in (("tiny_a", 7), ("tiny_b", 9)):  # the tiny model with its own SLURM resources
        (sizes / f"{name}.yaml").write_text(
            f"defaults:\n  - tiny\n  - _self_\nname: {name}\ngpus: null\nminutes: {minutes}\n"
        )
    overrides = [*(o for o in FAST if not o.startswith("size=")), "max_steps=4", "checkpoint.steps=[2,4]",
                 f"output_root={sweep}", f"data_root={workdir / 'data'}", "resume=auto",
                 f"hydra.searchpath=[file://{workdir / 'conf'}]"]
    launcher = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.tasks_per_node=1",
                "hydra.launcher.cpus_per_task=1"]
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "-m", *launcher, "size=tiny_a,tiny_b", *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        logs = "\n".join(
            f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(sweep.glob(".submitit/*/*_log.*"))
        )
        pytest.fail(f"the sweep did not finish in 300 s:\n{logs}")
    print(f"sweep of 2 jobs: {time.monotonic() - started:.0f} s")
    assert result.returncode == 0, result.stderr[-6000:]
    for size in ("tiny_a", "tiny_b"):
        run_dir = sweep / f"{size}-layer-s0"
        assert ckpt_step(run_dir / "checkpoints" / "last.ckpt") == 4
        assert sorted({key[0] for key in angle_table(run_dir)}) == [0, 2, 4]
    scripts = [p.read_text() for p in sweep.glob(".submitit/*/*_submission.sh")]
    assert len(scripts) == 2, "one job array per distinct set of resources"
    assert sorted(re.search(r"#SBATCH --time=(\d+)", s).group(1) for s in scripts) == ["7", "9"]
    assert all("#SBATCH --requeue" in s and "#SBATCH --signal=USR1@300" in s for s in scripts)
    status = sh(sys.executable, "-m", "normgeo.status", str(sweep), "--json", cwd=ROOT).stdout
    rows = [json.loads(line) for line in status.splitlines()]
    assert sorted((r["run"], r["state"], r["step"]) for r in rows) == [
        ("tiny_a-layer-s0", "finished", 4), ("tiny_b-layer-s0", "finished", 4)
    ]
