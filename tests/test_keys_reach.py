"""Issue 72: every key of train.py's schema reaches what it configures. The leaf keys are generated from the
schema (normgeo.config.schema.TrainSchema, the Trainer's node as conf/ composes it); each is set alone to a
valid value other than its default, and its value is looked for where it is used: the model, the AdamW
param groups and schedule, the Trainer, the data module, the checkpoint schedule, the plan (TrainSetup) or
the probe callback. A key this test does not know, or whose value does not arrive, fails by name. The
probe's options are also read by a real probe: one nobody reads there fails by name too."""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from callbacks.angle_probe import AngleProbe
from callbacks.run import build_trainer
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.config.schema import TrainSchema
from normgeo.measure.probe_config import ProbeConfig
from normgeo.run_folder import RunFolder
from normgeo.runs.build import make_datamodule, make_module, make_schedule
from normgeo.runs.preflight import setup_from_config
from tests.conftest import step_losses, train_here

BASE = ("size=tiny", "logger=csv", "trainer=cpu", "data=pydoc", "probe=pydoc", "probe.tokens=1024")


def composed(tmp_path: Path, *overrides: str) -> TrainSchema:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, f"output_root={tmp_path}", *overrides])
    return check_config("train", cfg)


class Built:
    """What train.py builds from a config (normgeo.runs.build, callbacks.run.build_trainer, its probe
    callback)."""

    def __init__(self, cfg: TrainSchema) -> None:
        self.cfg = cfg

    @cached_property
    def module(self):
        return make_module(self.cfg)

    @cached_property
    def gpt(self):
        return self.module.model.config

    @cached_property
    def optimizers(self) -> dict:
        return self.module.configure_optimizers()

    @property
    def group(self) -> dict:
        return self.optimizers["optimizer"].param_groups[0]

    def lr_factor(self, step: int) -> float:
        return self.optimizers["lr_scheduler"]["scheduler"].lr_lambdas[0](step)

    @cached_property
    def trainer(self):
        return build_trainer(self.cfg, Path(self.cfg.run_dir), [])

    @cached_property
    def data(self):
        return make_datamodule(self.cfg)

    @cached_property
    def schedule(self):
        return make_schedule(self.cfg)

    @cached_property
    def setup(self):
        return setup_from_config(self.cfg)

    @cached_property
    def probe(self) -> AngleProbe:  # as train.py builds it
        cfg = self.cfg
        return AngleProbe(cfg.run_dir, self.schedule, instantiate(cfg.probe.source),
                          f"normgeo-{cfg.size.name}", cfg.probe)


Check = tuple[str, Any, Callable[[Built], Any]]  # (override, the value where it arrives, where that is)


def probe_option(key: str) -> Callable[[Built], Any]:
    return lambda built: operator.attrgetter(key.removeprefix("probe."))(built.probe.config)


# Each key: a valid value other than its default, and where that value arrives.
ARRIVES: dict[str, Check] = {
    "seed": ("seed=7", 7, lambda b: (b.module.hparams.seed, b.data.seed) and b.module.hparams.seed),
    "run_name": ("run_name=other", "other", lambda b: Path(b.cfg.run_dir).name),
    "output_root": (None, None, None),  # composed() sets it: the run_dir's parent (below)
    "run_dir": ("run_dir=/tmp/elsewhere", "/tmp/elsewhere", lambda b: b.trainer.default_root_dir),
    "data_root": ("data_root=/tmp/d", "/tmp/d/pydoc", lambda b: str(b.data.directory)),
    "max_steps": ("max_steps=300", 300, lambda b: (b.trainer.max_steps, b.schedule.max_steps,
                                                   b.data.max_steps, b.module.hparams.max_steps)[0]),
    "global_batch": ("global_batch=32", 32, lambda b: b.setup.global_batch == b.data.global_batch
                     == b.module.hparams.global_batch and b.data.global_batch),
    "micro_batch": ("micro_batch=4", 4, lambda b: b.setup.micro_batch == b.data.micro_batch and
                    b.data.micro_batch),
    "seq_len": ("seq_len=64", 64, lambda b: b.data.seq_len == b.gpt.block_size and b.data.seq_len),
    "num_workers": ("num_workers=1", 1, lambda b: b.data.num_workers),
    "compile": ("compile=true", True, lambda b: b.module.hparams.compile and b.setup.compiled),
    "tie_embeddings": ("tie_embeddings=true", True, lambda b: b.gpt.tie_embeddings),
    "dropout": ("dropout=0.1", 0.1, lambda b: b.gpt.dropout),
    "bias": ("bias=false", False, lambda b: b.gpt.bias),
    "init_std": ("init_std=0.01", 0.01, lambda b: b.gpt.init_std),
    "vocab_multiple": ("vocab_multiple=128", 128, lambda b: b.gpt.vocab_multiple),
    "val_every": ("val_every=7", 7,
                  lambda b: b.trainer.val_check_interval // b.trainer.accumulate_grad_batches),
    "val_sequences": ("val_sequences=32", 32, lambda b: b.data.val_sequences),
    "val_seed": ("val_seed=5", 5, lambda b: b.data.val_seed),
    "log_every": ("log_every=3", 3, lambda b: b.trainer.log_every_n_steps),
    "norm.name": ("norm=rms", "rms", lambda b: b.gpt.norm),
    "norm.eps": ("norm.eps=1e-6", 1e-6, lambda b: b.gpt.norm_eps),
    "norm.impl": ("norm.impl=compiled", "compiled", lambda b: b.gpt.norm_impl),
    "placement.name": ("placement=post", "post", lambda b: b.gpt.placement),
    "placement.run_suffix": ("placement.run_suffix=-x", "tiny-layer-x-s0", lambda b: b.cfg.run_name),
    "size.name": ("size.name=small", "normgeo-small", lambda b: b.probe.model_name),
    "size.n_layer": ("size.n_layer=3", 3, lambda b: b.gpt.n_layer),
    "size.n_head": ("size.n_head=4", 4, lambda b: b.gpt.n_head),
    "size.n_embd": ("size.n_embd=96", 96, lambda b: b.gpt.n_embd),
    # The size's defaults of other keys (conf/train/train.yaml interpolates them).
    "size.seq_len": ("size.seq_len=64", 64, lambda b: b.gpt.block_size),
    "size.lr": ("size.lr=0.002", 0.002, lambda b: b.group["initial_lr"]),
    "size.warmup_steps": ("size.warmup_steps=5", 1 / 5, lambda b: b.lr_factor(0)),
    "size.max_steps": ("size.max_steps=300", 300, lambda b: b.trainer.max_steps),
    "size.micro_batch": ("size.micro_batch=4", 4, lambda b: b.data.micro_batch),
    "size.gpus": ("size.gpus=2", 2, lambda b: b.setup.world_size),  # trainer.devices=auto below
    "optim.lr": ("optim.lr=0.002", 0.002, lambda b: b.group["initial_lr"]),
    "optim.min_lr_ratio": ("optim.min_lr_ratio=0.2", pytest.approx(0.2), lambda b: b.lr_factor(10**6)),
    "optim.warmup_steps": ("optim.warmup_steps=5", 1 / 5, lambda b: b.lr_factor(0)),
    "optim.weight_decay": ("optim.weight_decay=0.05", 0.05, lambda b: b.group["weight_decay"]),
    "optim.betas": ("optim.betas=[0.8,0.9]", (0.8, 0.9), lambda b: b.group["betas"]),
    "optim.fused": ("optim.fused=true", True, lambda b: b.group["fused"]),
    "checkpoint.steps": ("checkpoint.steps=[5,10]", [5, 10], lambda b: b.schedule.explicit),
    "checkpoint.dense_every": ("checkpoint.dense_every=7", 7, lambda b: b.schedule.dense_every),
    "checkpoint.dense_until": ("checkpoint.dense_until=70", 70, lambda b: b.schedule.dense_until),
    "checkpoint.sparse_every": ("checkpoint.sparse_every=35", 35, lambda b: b.schedule.sparse_every),
    "checkpoint.last_every": ("checkpoint.last_every=3", 3, lambda b: b.schedule.last_every),
    "checkpoint.keep_optimizer": ("checkpoint.keep_optimizer=true", True,
                                  lambda b: b.schedule.keep_optimizer),
    "checkpoint.every_minutes": ("checkpoint.every_minutes=5", 5, lambda b: b.schedule.every_minutes),
    "data.name": ("data.name=mine", "mine", lambda b: b.data.name),
    "data.directory": ("data.directory=/tmp/p", "/tmp/p", lambda b: str(b.data.directory)),
    "data.tokenizer": ("data.tokenizer=r50k_base", "r50k_base", lambda b: b.data.tokenizer),
    "data.val_fraction": ("data.val_fraction=0.1", 0.1, lambda b: b.data.val_fraction),
    "data.auto_prepare": ("data.auto_prepare=false", False, lambda b: b.data.auto_prepare),
    "data.prepare_command": ("data.prepare_command=prep", "prep", lambda b: b.data.prepare_command),
    "data.seed": ("data.seed=9", 9, lambda b: b.data.seed),
    "probe.batch_size": ("probe.batch_size=4", 4, probe_option("probe.batch_size")),
    "plan.devices": ("plan.devices=4", 4, lambda b: b.setup.world_size),  # trainer.devices=auto below
    "trainer.accelerator": ("trainer.accelerator=auto", "auto", None),  # Lightning's (below)
}
# Keys read before or around what is built here, each with the test that follows its value there.
ELSEWHERE = {
    "threads": "tests/test_recorded_runs.py (train.train sets torch's CPU threads)",
    "resume": "tests/test_resume_rules.py, tests/test_resume_config.py (normgeo.runs.session)",
    "stop_at_step": "tests/test_training.py (ScheduledCheckpoint in train.train)",
    "size.minutes": "tests/test_slurm.py (the SLURM launcher's time limit)",
    "probe.enabled": "tests/test_training.py (train.train adds the probe callback or not)",
    "probe.figures": "tests/test_training.py (the figures drawn at the run's end)",
    "plan.check": "tests/test_plan.py, tests/test_start_faults.py (normgeo.runs.preflight)",
    "plan.device_memory_gib": "tests/test_plan.py (normgeo.runs.preflight's gate)",
    "plan.mfu": "tests/test_plan.py (normgeo.plan's planned time)",
    "plan.headroom_gib": "tests/test_plan.py (normgeo.runs.preflight's gate)",
    "plan.fragmentation": "tests/test_plan.py (normgeo.runs.preflight's gate)",
    "plan.gpus": "tests/test_plan.py (normgeo.plan's GPU table)",
}
# Instantiated whole by Hydra (their keys are the classes' own arguments, checked by the classes).
WHOLE_NODES = ("checkpoint._target_", "data._target_", "data.source", "probe.source", "logger")


def schema_leaves(kind: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(kind):
        if dataclasses.is_dataclass(f.default_factory):
            keys += schema_leaves(f.default_factory, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def trainer_leaves(tmp_path: Path) -> list[str]:
    return [f"trainer.{key}" for key in composed(tmp_path).trainer if key != "_target_"]


def test_every_leaf_key_is_known_here_by_where_its_value_arrives(tmp_path: Path) -> None:
    """A key added to the schema without a consumer checked here (or said to be elsewhere) fails by name."""
    probe_keys = {f"probe.{key}" for key in schema_leaves(ProbeConfig)}
    known = {*ARRIVES, *ELSEWHERE, *probe_keys, *trainer_leaves(tmp_path)}
    leaves = [key for key in schema_leaves(TrainSchema) if key != "trainer"]
    unknown = [key for key in leaves if key not in known and not key.startswith(WHOLE_NODES)]
    assert unknown == [], f"keys whose consumer nothing checks: {unknown}"
    assert not {*ARRIVES, *ELSEWHERE} - {*leaves, *trainer_leaves(tmp_path)}  # no stale entries


ARRIVING = {key: check for key, check in ARRIVES.items() if check[2] is not None}
PLANNED_DEVICES = ("trainer.devices=auto",)  # where size.gpus and plan.devices count


@pytest.fixture(scope="module")
def defaults(tmp_path_factory) -> dict[tuple[str, ...], Built]:
    """What the defaults build, by the other overrides a key's check needs."""
    folder = tmp_path_factory.mktemp("defaults")
    return {extra: Built(composed(folder, *extra)) for extra in ((), PLANNED_DEVICES)}


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(ARRIVING))
def test_a_keys_value_arrives_where_it_is_used(key: str, tmp_path: Path, defaults) -> None:
    override, value, where = ARRIVING[key]
    extra = PLANNED_DEVICES if key in ("size.gpus", "plan.devices") else ()
    arrived, default = where(Built(composed(tmp_path, override, *extra))), where(defaults[extra])
    assert arrived == value and default != value, (key, arrived, value, default)


def test_output_root_is_the_run_dirs_parent(tmp_path: Path) -> None:
    assert Path(composed(tmp_path).run_dir).parent == tmp_path


@pytest.mark.slow
def test_the_trainers_keys_arrive_in_lightnings_trainer(tmp_path: Path, monkeypatch) -> None:
    """Every trainer.* key of the composed node is an argument of the Trainer the run builds, as set."""
    received: dict = {}
    original = lightning.Trainer.__init__

    def recording(self, *args: Any, **kwargs: Any) -> None:
        received.update(kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(lightning.Trainer, "__init__", recording)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # deterministic=true sets it: restored after
    values = {"accelerator": "auto", "devices": 1, "num_nodes": 1, "strategy": "auto",
              "precision": "bf16-mixed", "gradient_clip_val": 0.5, "log_every_n_steps": 3,
              "enable_progress_bar": False, "enable_model_summary": True, "deterministic": True,
              "use_distributed_sampler": True}
    assert set(values) == {key.removeprefix("trainer.") for key in trainer_leaves(tmp_path)}
    cfg = composed(tmp_path, *(f"trainer.{key}={value}" for key, value in values.items()))
    try:
        build_trainer(cfg, Path(cfg.run_dir), [])
    finally:
        torch.use_deterministic_algorithms(False)  # as the other tests run
    assert {key: received[key] for key in values} == values


class Reads:
    """A probe config that notes every option read from it (nested nodes too)."""

    def __init__(self, config: Any, prefix: str, read: set[str]) -> None:
        self._config, self._prefix, self._read = config, prefix, read

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._config, name)
        if dataclasses.is_dataclass(value):
            return Reads(value, f"{self._prefix}{name}.", self._read)
        if not callable(value):
            self._read.add(f"{self._prefix}{name}")
        return value


@pytest.mark.slow
def test_every_probe_option_is_read_by_the_probe(tmp_path: Path) -> None:
    """One real probe at step 0 as train.py runs it (the callback on the run's module and Trainer): each
    of the probe's options is read there, or by train.py and conf/ (the source's keys)."""
    cfg = composed(tmp_path, "probe.tokens=256", "seq_len=64", "probe.batch_size=2",
                   "probe.intervention_tokens=128", "probe.null_directions=4",
                   "probe.bootstrap.replicates=20")
    built = Built(cfg)
    read: set[str] = set()
    probe = AngleProbe(cfg.run_dir, built.schedule, instantiate(cfg.probe.source), "m",
                       typing.cast(Any, Reads(cfg.probe, "probe.", read)))
    Path(cfg.run_dir).mkdir(parents=True)
    built.trainer.strategy.connect(built.module)
    probe.probe(built.trainer, built.module, step=0)
    by_train_and_conf = {"probe.source", "probe.path", "probe.plain_text_extensions", "probe.encoding",
                         "probe.enabled", "probe.figures"}
    options = {f"probe.{key}" for key in schema_leaves(type(cfg.probe))}
    assert sorted(options - read - by_train_and_conf) == []


def test_the_local_probes_keys_reach_its_source(tmp_path: Path) -> None:
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.md").write_text("some words\n")
    cfg = composed(tmp_path, "probe=local", f"probe.path={tmp_path / 'text'}", "probe.encoding=latin-1",
                   "probe.plain_text_extensions=[.md]")
    source = instantiate(cfg.probe.source)
    assert (str(source.path), source.encoding, tuple(source.plain_text_extensions)) == (
        str(tmp_path / "text"), "latin-1", (".md",))


@pytest.mark.slow
def test_a_run_trains_with_the_models_other_keys_changed(tmp_path: Path) -> None:
    """dropout, bias, init_std and vocab_multiple away from their defaults: two optimizer steps train, and
    the checkpoint holds the model they describe."""
    run_dir = tmp_path / "run"
    train_here(run_dir, "max_steps=2", "dropout=0.1", "bias=false", "init_std=0.05", "vocab_multiple=100")
    losses = step_losses(run_dir)
    assert sorted(losses) == [1, 2] and all(math.isfinite(loss) for loss in losses.values())
    weights = torch.load(RunFolder(run_dir).last_checkpoint, weights_only=False)["state_dict"]
    assert weights["model.wte.weight"].shape[0] == 50300  # 50,257 padded to a multiple of 100, not 64
    assert not [name for name in weights if name.endswith(("c_attn.bias", "c_fc.bias", "c_proj.bias"))]
