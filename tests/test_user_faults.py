"""Issue 20: every failure a user can cause fails early, says what to do, and leaves the run directory as
it found it (docs/reliability.md, both tables)."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from normgeo.runs.checks import check_config
from normgeo.runs.config import CONF_DIR
from normgeo.runs.schema import PRECISION_SHORT, PRECISIONS, ConfigError
from tests.conftest import ROOT


def tree(folder: Path) -> dict[str, tuple[int, bytes]] | None:
    """Every file under ``folder`` with its mtime and bytes (None: the folder is absent)."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def a_finished_run(run_dir: Path) -> Path:
    """A run directory as a finished run leaves it (what matters here: files that must not change)."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("max_steps: 3\n")
    (run_dir / "train.log").write_text("[train] done\n")
    (run_dir / "angles.jsonl").write_text('{"step": 0}\n')
    return run_dir


def composed_train(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


# 1. Lightning's own argument checks, before instantiate.

def test_lightning_precisions_are_the_schemas() -> None:
    import lightning.fabric.connector as connector

    lightning = {v for part in typing.get_args(connector._PRECISION_INPUT) for v in typing.get_args(part)}
    assert lightning == {*PRECISIONS, *PRECISION_SHORT}


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.devices=0"], "trainer.devices=0: expected a device count >= 1, -1 (all), auto"),
    (["trainer.devices=[]"], "trainer.devices=[]: expected a device count"),
    (["trainer.devices='0'"], "trainer.devices=0: expected a device count"),
    (["trainer.num_nodes=0"], "trainer.num_nodes=0: expected an integer >= 1"),
    (["trainer.precision=fp8"], "trainer.precision=fp8: expected null (bf16-mixed on GPUs that have it, else 32-true), 32-true"),
    (["trainer.accelerator=tpuu"], "trainer.accelerator=tpuu: expected one of auto, gpu, cpu"),
    (["trainer.strategy=dpp"], "trainer.strategy=dpp: expected auto, ddp, ddp_spawn, fsdp, deepspeed"),
    (["trainer=ddp", "trainer.strategy._target_=no.such.Strategy"],
     "trainer.strategy._target_=no.such.Strategy: expected the import path of a lightning.pytorch.strategies.Strategy"),
    (["trainer=ddp", "trainer.strategy._target_=lightning.Trainer"], "trainer.strategy._target_=lightning.Trainer"),
])
def test_trainer_arguments_lightning_refuses_are_refused_at_compose_time(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_config("train", composed_train(*overrides))
    assert str(refused.value).startswith(message), refused.value


@pytest.mark.parametrize("overrides", [
    [], ["trainer=cpu"], ["trainer=gpu"], ["trainer=ddp"], ["trainer=ddp_cpu"], ["trainer=fsdp"],
    ["trainer.devices=-1"], ["trainer.devices=[0,1]"], ["trainer.devices='0,1'"], ["trainer.devices='2'"],
    ["trainer.precision=16"], ["trainer.precision=bf16"], ["trainer.precision=bf16-mixed"], ["trainer.strategy=DDP"],
    ["trainer.strategy=fsdp"], ["trainer.accelerator=cuda"],
])
def test_trainer_arguments_lightning_accepts_pass(overrides: list[str]) -> None:
    check_config("train", composed_train(*overrides))


@pytest.mark.slow
@pytest.mark.parametrize(("override", "message"), [
    ("trainer.devices=0", "error: trainer.devices=0: expected a device count >= 1"),
    ("trainer.precision=fp8", "error: trainer.precision=fp8: expected null"),
])
def test_trainer_arguments_exit_2_and_leave_the_run_directory_as_it_was(override: str, message: str,
                                                                       tmp_path: Path) -> None:
    run_dir = a_finished_run(tmp_path / "run")
    before = tree(run_dir)
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "experiment=smoke", override, f"run_dir={run_dir}",
                           f"data_root={tmp_path / 'data'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr[-3000:]
    assert tree(run_dir) == before
    assert not (tmp_path / "data").exists()
