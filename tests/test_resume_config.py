"""A resumed run is the same experiment: a changed setting that alters the math is refused (exit 2),
devices, paths, loggers and the micro batch may change (normgeo/runs/run_config.py)."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

from models.hardware import default_precision
from models.norms import compile_refusal
from normgeo.config import schema
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.config.schema import CHECKPOINT_SCHEDULE, compiles
from normgeo.run_folder import RUN_CONFIG_FILE
from normgeo.runs import run_config
from normgeo.runs.build import make_module
from normgeo.runs.formats import added_keys
from normgeo.runs.run_config import (
    ABSENT,
    ALLOWED_CHANGES,
    ResumeConfigError,
    checkpoint_run_config,
    config_changes,
    load_run_config,
    record_run_config,
    resolved_run_config,
    verify_run_config,
)
from tests.conftest import (
    FAST,
    call_entry_point,
    metrics_rows,
    run_train,
    step_losses,
    train_here,
    train_in_process,
)

# 4 steps, no probe (it is not what is tested here, and each session is a subprocess on 2 CPU cores).
COMMON = ["max_steps=4", "probe.enabled=false", "checkpoint.last_every=1"]


def resolved(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = compose("train", overrides=["logger=csv", *overrides])
        return resolved_run_config(check_config("train", composed))


# --- the comparison -----------------------------------------------------------------------------------


BASE = {
    "seed": 0,
    "micro_batch": 4,
    "resume": None,
    "optim": {"lr": 1e-3, "betas": [0.9, 0.95]},
    "trainer": {"devices": 1, "strategy": "auto", "precision": "32-true"},
    "data": {"directory": "/data/pydoc", "seed": 0},
    "logger": {"csv": {"_target_": "CSVLogger"}},
}


def test_allowed_keys_are_ignored() -> None:
    new = {
        **BASE,
        "micro_batch": 2,
        "resume": "auto",
        "stop_at_step": 10,  # absent before: still allowed
        "trainer": {
            "devices": 2,
            "strategy": {"_target_": "DDPStrategy", "process_group_backend": "gloo"},
            "precision": "32-true",
        },
        "data": {"directory": "/elsewhere/pydoc", "seed": 0},
        "logger": {},
    }
    assert config_changes(BASE, new) == {}


def test_nested_changes_are_reported_old_to_new() -> None:
    new = {
        **BASE,
        "optim": {"lr": 0.5, "betas": [0.9, 0.99]},
        "trainer": {**BASE["trainer"], "precision": "bf16-mixed"},
    }
    changes = config_changes(BASE, new)
    assert changes == {
        "optim.lr": (1e-3, 0.5),
        "optim.betas": ([0.9, 0.95], [0.9, 0.99]),
        "trainer.precision": ("32-true", "bf16-mixed"),
    }
    message = str(ResumeConfigError(changes, "last.ckpt"))
    assert "  optim.lr: 0.001 → 0.5\n" in message
    assert "  optim.betas: [0.9, 0.95] → [0.9, 0.99]\n" in message
    assert "  trainer.precision: 32-true → bf16-mixed\n" in message
    assert "run_name=" in message and "seed=" in message and "original values" in message


def test_the_copies_older_runs_recorded_are_no_change_but_keys_the_schema_declares_count() -> None:
    """model, checkpoint.max_steps and data.seq_len, ... copied other keys while conf/ held them
    (normgeo/runs/build.py passes those values now): recorded by an old session, they are keys the schema no
    longer declares, compared through the keys they copied (run_config.declared: no list to keep); a key the
    schema declares, absent from this session's config, is a change; checkpoint._target_, which older runs
    lack, has the value they ran with (its ``before``)."""
    copies = {
        "model": {"_target_": "models.lit.LitGPT", "lr": 1e-3},
        "checkpoint": {"max_steps": 4},
        "data": {**BASE["data"], "seq_len": 64, "micro_batch": 4, "val_seed": None},
    }
    old = {**BASE, **copies}
    assert config_changes(old, BASE) == {}
    assert config_changes(old, {**BASE, "checkpoint": {"_target_": CHECKPOINT_SCHEDULE}}) == {}
    assert config_changes(old, {**BASE, "checkpoint": {"_target_": "mine.Schedule"}}) == {
        "checkpoint._target_": (CHECKPOINT_SCHEDULE, "mine.Schedule")}
    assert config_changes({**old, "tie_embeddings": False}, BASE) == {"tie_embeddings": (False, ABSENT)}


def test_keys_on_one_side_only_are_changes() -> None:
    old = {**BASE, "tie_embeddings": False}
    new = {**BASE, "optim": {**BASE["optim"], "eps": 1e-8}}
    changes = config_changes(old, new)
    assert changes == {"tie_embeddings": (False, ABSENT), "optim.eps": (ABSENT, 1e-8)}
    message = str(ResumeConfigError(changes, "run_config.yaml"))
    assert "tie_embeddings: false → <absent>" in message and "optim.eps: <absent> → 1e-08" in message


def test_a_flag_that_became_a_number_is_a_change() -> None:
    assert config_changes({"tie_embeddings": True}, {"tie_embeddings": 1}) == {"tie_embeddings": (True, 1)}
    assert config_changes({"optim": {"lr": 1}}, {"optim": {"lr": 1.0}}) == {}


def test_one_device_to_two_ddp_processes_is_the_same_experiment_but_precision_is_not() -> None:
    one = resolved("trainer=cpu", "global_batch=8", "micro_batch=4")
    two = resolved("trainer=ddp_cpu", "trainer.devices=2", "global_batch=8", "micro_batch=4")
    assert one["trainer"]["strategy"] != two["trainer"]["strategy"]
    assert config_changes(one, two) == {}
    half = resolved("trainer=ddp_cpu", "trainer.devices=2", "global_batch=8", "trainer.precision=bf16-mixed")
    assert config_changes(one, half) == {"trainer.precision": ("32-true", "bf16-mixed")}


def test_paths_and_per_device_settings_may_change() -> None:
    before = resolved("run_name=a", "data_root=/x", "output_root=/o", "micro_batch=8", "num_workers=0")
    after = resolved(
        "run_name=b",
        "data_root=/y",
        "output_root=/p",
        "micro_batch=2",
        "num_workers=4",
        "probe.batch_size=2",
        "log_every=100",
        "checkpoint.last_every=7",
        "compile=true",
        "norm.impl=compiled",  # the same modules and weights, their forwards compiled
    )
    assert config_changes(before, after) == {}
    # A run recorded before norm.impl existed resumes with it too (stock was all there was).
    old_record = {**before, "norm": {k: v for k, v in before["norm"].items() if k != "impl"}}
    assert config_changes(old_record, after) == {}


def test_precision_null_is_recorded_as_what_it_means_here() -> None:
    assert resolved("trainer=default")["trainer"]["precision"] == default_precision()


def test_compile_auto_is_off_on_the_cpu_on_for_cuda_and_recorded_as_decided(monkeypatch) -> None:
    """Issue 61, item 1: compile=auto (the default) compiles CUDA training only; true/false stay as set."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cpu, gpu, auto, forced = (
            check_config("train", compose("train", overrides=overrides)) for overrides in (
                ["trainer=cpu"], ["trainer=gpu"],
                ["trainer=default"],  # accelerator=auto: a GPU when there is one
                ["trainer=cpu", "compile=true"]))
    assert cpu.compile == "auto" and resolved_run_config(cpu)["compile"] is False
    assert make_module(cpu).hparams.compile is False
    assert compiles(forced) is True and compiles(cpu, "cuda") == (compile_refusal("cuda") is None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compiles(auto) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(schema, "compile_refusal", lambda device_type: None)  # Triton there
    assert compiles(auto) is True and compiles(gpu) is True
    monkeypatch.setattr(schema, "compile_refusal", lambda device_type: "no Triton")
    assert compiles(gpu) is False  # auto falls back to eager where torch.compile cannot run


# --- saving and reading -------------------------------------------------------------------------------


def test_run_config_is_saved_once_and_read_back_exactly(tmp_path: Path, caplog) -> None:
    config = resolved()
    assert record_run_config(tmp_path, config)
    assert load_run_config(tmp_path) == config
    written = (tmp_path / RUN_CONFIG_FILE).read_bytes()
    assert not record_run_config(tmp_path, {**config, "seed": 7})  # never replaced
    assert (tmp_path / RUN_CONFIG_FILE).read_bytes() == written
    (tmp_path / RUN_CONFIG_FILE).write_text("- not a mapping\n")  # damaged (a resume's): rewritten, and said
    with caplog.at_level(logging.WARNING):
        assert record_run_config(tmp_path, config)
    assert load_run_config(tmp_path) == config and "rewritten from the checkpoint's copy" in caplog.text


def test_the_checkpoints_config_is_preferred_to_the_file(tmp_path: Path) -> None:
    config = resolved()
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "run_config": {**config, "seed": 3}}, ckpt)
    record_run_config(tmp_path, config)
    with pytest.raises(ResumeConfigError, match="seed: 3 → 0") as err:
        verify_run_config(tmp_path, str(ckpt), config)
    assert str(ckpt) in str(err.value)


def test_an_old_checkpoint_falls_back_to_the_file_then_only_warns(tmp_path: Path, caplog) -> None:
    config = resolved()
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, ckpt)
    assert checkpoint_run_config(ckpt) is None
    with caplog.at_level(logging.WARNING):
        verify_run_config(tmp_path, str(ckpt), {**config, "seed": 5})
    assert "holds no run config" in caplog.text
    record_run_config(tmp_path, config)
    with pytest.raises(ResumeConfigError, match="seed: 0 → 5"):
        verify_run_config(tmp_path, str(ckpt), {**config, "seed": 5})


def test_a_fresh_start_checks_a_config_left_without_checkpoints(tmp_path: Path) -> None:
    config = resolved()
    verify_run_config(tmp_path, None, config)  # nothing there
    record_run_config(tmp_path, config)
    verify_run_config(tmp_path, None, {**config, "micro_batch": 1})
    with pytest.raises(ResumeConfigError, match="delete"):
        verify_run_config(tmp_path, None, {**config, "global_batch": 128})


# --- end to end ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A run of 4 steps stopped after step 2 on one device: the refused resumes all try to continue it."""
    run_dir = tmp_path_factory.mktemp("resume-config") / "run"
    train_here(run_dir, *COMMON, "stop_at_step=2")
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    return run_dir


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("resume-config") / "whole"
    train_here(run_dir, *COMMON)
    return run_dir


def snapshot(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of the run but Hydra's own (.hydra/, train.log: written before train.py runs)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and ".hydra" not in p.parts and p.suffix != ".log"
    }


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["norm=rms"], ["norm.name: layer → rms"]),
        (["seed=1"], ["seed: 0 → 1"]),
        (["global_batch=16"], ["global_batch: 8 → 16"]),
        (["optim.lr=0.5"], ["optim.lr: 0.001 → 0.5"]),
        (["max_steps=5"], ["max_steps: 4 → 5"]),
        (["seq_len=32"], ["seq_len: 64 → 32"]),
        (["norm=rms", "optim.lr=0.5"], ["norm.name: layer → rms", "optim.lr: 0.001 → 0.5"]),
    ],
)
@pytest.mark.slow
def test_a_changed_experiment_is_refused_and_leaves_the_run_untouched(
    stopped_run: Path, overrides: list[str], expected: list[str], capsys
) -> None:
    """Through train.py's Hydra main in this process (conftest.call_entry_point: its exit code and stderr)."""
    assert (stopped_run / RUN_CONFIG_FILE).exists()
    before = snapshot(stopped_run)
    code, stderr = call_entry_point(
        "train",
        [
            *FAST,
            f"run_dir={stopped_run}",
            f"data_root={stopped_run.parent / 'data'}",
            *COMMON,
            "resume=auto",
            *overrides,
        ],
        capsys,
    )
    assert code == 2, stderr[-3000:]
    for line in expected:
        assert line in stderr, stderr[-3000:]
    assert "run_name=" in stderr and "original values" in stderr
    assert snapshot(stopped_run) == before


@pytest.mark.slow
def test_a_smaller_micro_batch_and_another_stop_step_are_accepted(
    stopped_run: Path, whole_run: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "moved"  # a copy elsewhere: run_dir may change too
    shutil.copytree(stopped_run, run_dir)
    saved = (run_dir / RUN_CONFIG_FILE).read_bytes()
    train_here(run_dir, *COMMON, "resume=auto", "micro_batch=2", "stop_at_step=3")
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3
    assert last["run_config"]["micro_batch"] == 2 and last["run_config"]["run_dir"] == str(run_dir)
    assert (run_dir / RUN_CONFIG_FILE).read_bytes() == saved  # the first session's, kept
    losses, whole = step_losses(run_dir), step_losses(whole_run)
    assert sorted(losses) == [1, 2, 3]
    # 4 accumulated micro-batches of 2 instead of 2 of 4: same tokens, only the summation order differs.
    assert all(losses[step] == pytest.approx(whole[step], rel=1e-5) for step in losses)


@pytest.mark.slow
def test_resuming_on_two_ddp_processes_continues_the_one_device_run(
    stopped_run: Path, whole_run: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "ddp"
    shutil.copytree(stopped_run, run_dir)
    run_train(run_dir, *COMMON, "resume=auto", "trainer=ddp_cpu", "trainer.devices=2")
    assert checkpoint_run_config(run_dir / "checkpoints" / "last.ckpt")["trainer"]["devices"] == 2
    losses, whole = step_losses(run_dir), step_losses(whole_run)
    assert sorted(losses) == sorted(whole) == [1, 2, 3, 4]
    for step, loss in whole.items():
        # Same tokens, same weights after step 2: only the order of the gradient all-reduce and of the
        # loss mean over ranks differs from one device's accumulation, so the losses agree to float32.
        assert losses[step] == pytest.approx(loss, rel=1e-5), step


# --- what a resume may do, said on each key (normgeo/config/schema.py, issue 62 item 2) -----------------


@schema.schema
class LaterSchema(schema.TrainSchema):
    """train.py's schema with two keys added later, as a change to the schema alone would add them."""

    knob: int = schema.doc(3, "a key added later: every run recorded before it ran with 3", before=3)
    shown: str = schema.doc("a", "a key added later that may change between sessions", may_change=True)


@contextlib.contextmanager
def later_schema(monkeypatch) -> Iterator[None]:
    """LaterSchema as train.py's schema: composed (the ConfigStore), checked and read for the resume rules."""
    with monkeypatch.context() as patch:
        patch.setattr(schema, "TrainSchema", LaterSchema)
        patch.setattr(run_config, "TrainSchema", LaterSchema)
        ConfigStore.instance().store(name="train_schema", node=LaterSchema)
        try:
            yield
        finally:
            schema.register()  # the real schema back in the ConfigStore


def test_the_resume_rules_are_the_schemas_and_cover_plan_and_mean_sources() -> None:
    allowed, before = run_config.resume_rules(schema.TrainSchema), added_keys(schema.TrainSchema)
    assert allowed == ALLOWED_CHANGES
    assert {"plan", "probe.mean_sources", "trainer.devices", "compile"} <= set(allowed)
    assert before["probe.intervention_tokens"] is None and before["data.source.encoding"] == "utf-8"
    old = resolved()
    new = resolved("plan.check=false", "plan.gpus=[a6000]", "probe.mean_sources=false")
    assert config_changes(old, new) == {}
    del old["probe"]["mean_sources"], old["plan"]  # a run recorded before they existed
    assert config_changes(old, new) == {}
    del old["probe"]["intervention_tokens"]  # recorded before it: every probe token was intervened on
    assert config_changes(old, resolved("probe.intervention_tokens=null")) == {}
    assert config_changes(old, resolved("probe.intervention_tokens=64")) == {
        "probe.intervention_tokens": (None, 64)}


def test_a_key_added_to_the_schema_says_what_a_run_recorded_without_it_resumes_with(monkeypatch) -> None:
    old = resolved()  # recorded without knob and shown
    assert "knob" not in old
    with later_schema(monkeypatch):
        new = resolved("shown=b")
        assert new["knob"] == 3 and config_changes(old, new) == {}
        assert config_changes(old, {**new, "knob": 4}) == {"knob": (3, 4)}
    # The rules are the schema's: under today's, neither key is known to an old record.
    assert config_changes(old, new) == {"knob": (ABSENT, 3), "shown": (ABSENT, "b")}


@pytest.mark.slow
def test_runs_recorded_before_a_key_existed_resume_and_plan_may_change(
    stopped_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A real run recorded before probe.mean_sources and plan existed (deleted from its run_config.yaml and
    checkpoint) resumes on today's code with plan.check changed; then with a key added to the schema alone
    (LaterSchema): its recorded value resumes, another is refused."""
    run_dir = tmp_path / "old"
    shutil.copytree(stopped_run, run_dir)
    saved = yaml.safe_load((run_dir / RUN_CONFIG_FILE).read_text())
    assert saved["probe"].pop("mean_sources") is True and saved.pop("plan")["check"] is True
    (run_dir / RUN_CONFIG_FILE).write_text(yaml.safe_dump(saved, sort_keys=False))
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    last["run_config"] = saved
    torch.save(last, run_dir / "checkpoints" / "last.ckpt")
    train_here(run_dir, *COMMON, "resume=auto", "stop_at_step=3", "plan.check=false")
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3
    with later_schema(monkeypatch):
        refused = train_in_process(run_dir, *COMMON, "resume=auto", "knob=4", capsys=capsys)
        assert refused.returncode == 2 and "knob: 3 → 4" in refused.stderr, refused.stderr[-2000:]
        train_here(run_dir, *COMMON, "resume=auto", "shown=b")
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 4 and last["run_config"]["knob"] == 3


CHANGED = ["max_steps=6", "val_every=3", "val_sequences=2", "probe.enabled=false", "checkpoint.last_every=1"]


@pytest.fixture(scope="module")
def validated_runs(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run at micro_batch 4 (2 micro-batches a step), and a copy stopped after step 3."""
    root = tmp_path_factory.mktemp("micro-batch")
    train_here(root / "whole", *CHANGED)
    train_here(root / "stopped", *CHANGED, "stop_at_step=3")
    return root / "whole", root / "stopped"


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [2, 8])
def test_a_resume_with_another_micro_batch_trains_and_validates_as_the_uninterrupted_run(
    validated_runs: tuple[Path, Path], tmp_path: Path, micro_batch: int
) -> None:
    """Issue 75, class 1: micro_batch may change on resume, and changes nothing but the summation order.
    Before: the loop's batch counter kept the old accumulation's unit, so the next optimizer steps closed
    after the wrong micro-batches (other batches: loss 10.652 against 10.702 at step 4) and the validation
    moved from step 6 to 5; and val_sequences=2 validated max(2, micro_batch) windows, another loss for the
    same weights."""
    whole, stopped = validated_runs
    run_dir = tmp_path / "resumed"
    shutil.copytree(stopped, run_dir)
    train_here(run_dir, *CHANGED, "resume=auto", f"micro_batch={micro_batch}")
    losses, reference = step_losses(run_dir), step_losses(whole)
    assert sorted(losses) == sorted(reference) == list(range(1, 7))
    assert all(losses[step] == pytest.approx(reference[step], rel=1e-5) for step in reference)
    validations = {int(r["step"]): float(r["val/loss"]) for r in metrics_rows(run_dir) if r.get("val/loss")}
    expected = {int(r["step"]): float(r["val/loss"]) for r in metrics_rows(whole) if r.get("val/loss")}
    assert sorted(validations) == sorted(expected) == [3, 6]
    assert all(validations[step] == pytest.approx(expected[step], rel=1e-5) for step in expected)
