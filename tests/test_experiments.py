"""Every trainer option builds its Trainer, and every experiment config trains for 2 steps.

The lightning-hydra-template habit: a config that only resolves is untested. The experiments run as
written, with overrides only for what this machine lacks:
- no GPU: ``trainer.accelerator=cpu trainer.devices=2`` (the strategy and precision the config asks
  for are kept; on CPU the default precision resolves to 32-true);
- the record: ``logger=csv log_every=1``, to read both steps' losses;
- compute: ``seq_len=32``, ``global_batch=4``, ``micro_batch=2`` (the paper's 64 x 1024 tokens per step
  would take minutes per step on 2 cores), ``max_steps=2``, ``probe.tokens=128``;
- memory and time: the 160m, 410m and 1b presets keep their width, heads and vocabulary but run with
  ``size.n_layer=1`` on one process of their DDP strategy (``trainer.devices=1``): with all layers the 1b
  preset's fp32 weights + gradients + AdamW state are 16 GB per process. ``paper_grid``'s 70m column runs
  the same way; two processes of DDP run in ``paper``, which differs from these only in the size. The
  one-process runs train in the test's process (:func:`train_in_this_process`: seconds of imports saved per
  run), as do ``smoke`` and ``study_cpu``, which ask for one device (on this machine) as written;
- no network: ``data=local`` on the shared OpenWebText sample and ``probe=local`` on the shared
  Wikipedia text stand in for the Hub downloads (``data=openwebtext``, ``probe=wikipedia``).
``paper_70m`` (= ``paper``, whose default size is 70m) runs with ``trainer=fsdp`` (FSDP2, bf16 all-gathers as
configured), ``paper`` as configured (DDP), and the tiny model
runs FSDP2 with every GPU option on (bf16 autocast, activation checkpointing, compiled blocks).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from omegaconf import OmegaConf

import callbacks.run
from models.strategies import FSDP2Strategy
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.measure.records import read_rows
from tests.conftest import ROOT, entry_point_here, run_train, step_losses

TRAINERS = sorted(p.stem for p in (Path(CONF_DIR) / "trainer").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
STRATEGY_OF = {
    "cpu": SingleDeviceStrategy,
    "default": SingleDeviceStrategy,
    "gpu": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "ddp_cpu": DDPStrategy,
    "fsdp": FSDP2Strategy,
}


def test_the_trainer_options_are_the_documented_ones() -> None:
    assert sorted(STRATEGY_OF) == TRAINERS


@pytest.mark.parametrize("option", TRAINERS)
def test_every_trainer_option_builds_its_trainer(option: str, tmp_path: Path, monkeypatch) -> None:
    """Composed and instantiated as train.py does, with SLURM's node count in the environment."""
    monkeypatch.setenv("SLURM_NNODES", "1")  # a string in the environment: must become the int 1
    overrides = [f"trainer={option}", "trainer.accelerator=cpu", "logger=csv", f"run_dir={tmp_path}"]
    if option in ("ddp", "fsdp"):
        overrides.append("trainer.devices=2")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = check_config("train", compose("train", overrides=overrides))
    trainer = callbacks.run.build_trainer(cfg, tmp_path, callbacks=[])
    assert isinstance(trainer.strategy, STRATEGY_OF[option]), type(trainer.strategy)
    assert trainer.num_nodes == 1 and isinstance(trainer.num_nodes, int)
    assert trainer.num_devices == (2 if option in ("ddp", "ddp_cpu", "fsdp") else 1)
    assert trainer.precision == "32-true"  # the CPU default of precision=null
    assert trainer.accumulate_grad_batches == cfg.global_batch // (cfg.micro_batch * trainer.world_size)


# The wider presets and the grid differ from paper only in their sizes: they train on one process of their DDP
# strategy (the two-process DDP path is paper's), with 1 of their layers: their width is what differs.
ONE_PROCESS = ("paper_160m", "paper_410m", "paper_1b", "paper_grid")


# As written, these train on one device of this machine (the default trainer's devices=auto; trainer=cpu).
ONE_DEVICE = ("smoke", "study_cpu")


def experiment_overrides(experiment: str, shared: Path) -> list[str]:
    overrides = [
        f"experiment={experiment}",
        "trainer.accelerator=cpu",
        *([] if experiment in ONE_DEVICE else ["trainer.devices=2"]),
        "trainer.enable_progress_bar=false",
        "seq_len=32",
        "global_batch=4",
        "micro_batch=2",
        "max_steps=2",
        "optim.warmup_steps=0",  # fewer warm-up steps than max_steps (else a warning at start), and
        "optim.lr=1e-6",  # about the rate the paper's 500-1000 warm-up steps give their first steps
        "probe.tokens=128",
        "logger=csv",  # wandb (the paper's logger) runs offline in test_training.py
        "log_every=1",  # the paper logs every 10 steps: this puts both steps' losses in metrics.csv
    ]
    if experiment.startswith("paper"):
        overrides += [
            "data=local",
            f"data.source.path={shared / 'corpora' / 'webtext' / 'openwebtext-10k.sujen07.val.dedup.jsonl'}",
            "probe=local",
            f"probe.path={shared / 'corpora' / 'wikipedia' / 'wikitext-2-raw'}",
            "probe.tokens=128",
        ]
    if experiment == "study_cpu":  # real local text already; the shared folder wherever it is
        overrides += [
            f"data.source.path={shared / 'corpora' / 'webtext' / 'openwebtext-10k.sujen07.val.dedup.jsonl'}",
            f"probe.path={shared / 'corpora' / 'wikipedia' / 'wikitext-2-raw'}",
            # its schedule's steps 100 ... 1000 are beyond max_steps=2: refused
            "checkpoint.steps=[2]",
        ]
    if experiment in ONE_PROCESS:
        overrides += ["size.n_layer=1", "trainer.devices=1"]
    return overrides


def run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def train_in_this_process(args: list[str]) -> None:
    """``python train.py <args>`` of a one-process run through train.py's main in this process. A DDP
    strategy's process group (of one) and its launcher's environment (MASTER_PORT, WORLD_SIZE, LOCAL_RANK,
    ...) outlive Lightning's teardown: both are undone here, or they would reach this worker's later runs."""
    environment = dict(os.environ)
    try:
        done = entry_point_here("train", args)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    assert done.returncode == 0, f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def check_trained(run_dir: Path) -> None:
    assert sorted(step_losses(run_dir)) == [1, 2], run_dir
    assert all(0 < loss < 12 for loss in step_losses(run_dir).values())
    rows = read_rows(run_dir / "angles.jsonl")
    assert {r["step"] for r in rows} >= {0} and all(r["count"] == 128 for r in rows)
    last = torch.load(
        run_dir / "checkpoints" / "last.ckpt", map_location="cpu", mmap=True, weights_only=False
    )
    assert last["global_step"] == 2


# paper_70m is paper.yaml with size 70m (paper's own default): identical runs, so paper_70m runs once,
# under trainer=fsdp, and paper as configured (DDP).
RUNS = [(e, "trainer=fsdp" if e == "paper_70m" else None) for e in EXPERIMENTS if e != "paper_grid"]


def test_paper_and_paper_70m_are_the_same_run() -> None:
    """What lets RUNS run paper_70m under FSDP only: as configured it is exactly paper."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        paper, paper_70m = (compose("train", overrides=[f"experiment={e}"]) for e in ("paper", "paper_70m"))
    assert OmegaConf.to_container(paper, resolve=True) == OmegaConf.to_container(paper_70m, resolve=True)


@pytest.mark.parametrize(("experiment", "extra"), RUNS)
@pytest.mark.slow
def test_every_experiment_trains_two_steps(
    experiment: str, extra: str | None, shared: Path, tmp_path_factory
) -> None:
    root = tmp_path_factory.getbasetemp() / "experiments"  # one prepared corpus for all of them
    run_dir = root / f"{experiment}-{(extra or 'as-configured').replace('=', '-')}"
    args = [*experiment_overrides(experiment, shared), *([extra] if extra else []), f"run_dir={run_dir}",
            f"data_root={root / 'data'}"]
    if experiment in ONE_PROCESS or experiment in ONE_DEVICE:
        train_in_this_process(args)
    else:
        run([sys.executable, "train.py", *args])
    check_trained(run_dir)
    shutil.rmtree(run_dir / "checkpoints")  # up to 3.7 GB for the 1b preset


@pytest.mark.slow
def test_fsdp_with_its_gpu_options_trains_on_cpu(tmp_path: Path) -> None:
    """trainer=fsdp as on a GPU node: bf16 autocast, fused AdamW with clipping, bf16 all-gathers, activation
    checkpointing, compiled blocks."""
    gpu_like = [
        "trainer.precision=bf16-mixed",
        "optim.fused=true",
        "trainer.strategy.activation_checkpointing=true",
        "compile=true",
    ]
    done = run_train(tmp_path / "run", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
                     "micro_batch=2", "max_steps=2", "checkpoint.steps=[2]", *gpu_like)
    log = done.stdout + done.stderr
    assert "param dtype bfloat16" in log and "activation checkpointing True" in log
    assert "torch.compile: model compiled" in log
    assert sorted(step_losses(tmp_path / "run")) == [1, 2]
    rows = read_rows(tmp_path / "run" / "angles.jsonl")
    assert sorted({r["step"] for r in rows}) == [0, 2] and all(r["count"] == 512 for r in rows)
    # The sharded gains are gathered for the output ellipsoid: every norm of every step, full width.
    ellipsoid = read_rows(tmp_path / "run" / "ellipsoid.jsonl")
    assert len(ellipsoid) == 2 * 5 and all(r["axes_dim"] == r["dim"] - 1 for r in ellipsoid)
    assert all(r["count"] == 512 for r in read_rows(tmp_path / "run" / "energy.jsonl"))


@pytest.mark.slow
def test_paper_grid_sweeps_both_norms(shared: Path, tmp_path_factory) -> None:
    """The grid is a Hydra multirun (2 norms x 4 sizes); here its 70m column: both norms, one after the
    other."""
    root = tmp_path_factory.getbasetemp() / "experiments"
    outputs = root / "grid"
    train_in_this_process(["-m", *experiment_overrides("paper_grid", shared), "hydra.sweeper.params.size=70m",
                           f"output_root={outputs}", f"data_root={root / 'data'}"])
    for norm in ("layer", "rms"):
        check_trained(outputs / f"70m-{norm}-s0")
        shutil.rmtree(outputs / f"70m-{norm}-s0" / "checkpoints")
