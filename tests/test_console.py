"""The training console: progress in optimizer steps, and none of Lightning's start-up noise."""

from __future__ import annotations

import io
import logging
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.warnings import PossibleUserWarning
from omegaconf import OmegaConf

from callbacks.progress import (
    StepProgressBar,
    bar_format,
    eta_seconds,
    format_duration,
    quiet_lightning,
    status_fields,
)
from tests.conftest import ROOT, run_train


def test_eta_is_the_steps_left_at_this_sessions_mean_pace() -> None:
    assert eta_seconds(10, 100, since_step=0, elapsed=20.0) == 180.0
    assert eta_seconds(60, 100, since_step=50, elapsed=5.0) == 20.0  # resumed at 50: 10 steps in 5 s
    assert eta_seconds(50, 100, since_step=50, elapsed=5.0) is None  # no step timed yet
    assert eta_seconds(100, 100, since_step=0, elapsed=9.0) == 0.0
    assert eta_seconds(5, 0, since_step=0, elapsed=1.0) is None  # no max_steps


def test_durations_counts_and_status_fields_read_naturally() -> None:
    assert [format_duration(s) for s in (None, 7.4, 754, 10921, 2 * 86400 + 3 * 3600 + 121)] == [
        "?",
        "00:07",
        "12:34",
        "3:02:01",
        "51:02:01",
    ]
    metrics = {"loss": 10.414321, "tok/s": 581.2, "val/loss": 10.2, "v_num": 0}
    assert status_fields(metrics, elapsed=71, eta=3725, total=6) == [
        "loss 10.4143",
        "val/loss 10.2000",
        "581 train tok/s",
        "01:11 elapsed",
        "ETA 1:02:05",
    ]
    assert status_fields({}, elapsed=1, eta=None, total=0) == ["00:01 elapsed"]
    # Issue 34: two "step 100/100" lines showed different val/loss; each now says which validation it is.
    assert (
        status_fields(metrics, elapsed=71, eta=0, total=6, validated_at=4)[1] == "val/loss 10.2000 (step 4)"
    )


def test_the_bar_narrows_and_then_goes_on_a_narrow_terminal() -> None:
    text = "loss 2.0000 · 12.3k train tok/s · 0:01 elapsed · ETA 0:00"  # 57 characters
    assert "{bar:20}" in bar_format(5, 5, text, 0)  # unknown width
    assert "{bar:20}" in bar_format(5, 5, text, 200)
    assert "{bar:6}" in bar_format(5, 5, text, 76)
    assert "{bar" not in bar_format(5, 5, text, 40)


def test_the_count_starts_at_the_restored_step_and_moves_on_optimizer_steps(caplog) -> None:
    trainer = SimpleNamespace(max_steps=100, global_step=50, progress_bar_metrics={}, sanity_checking=False,
                              log_every_n_steps=1)
    out = io.StringIO()
    bar = StepProgressBar(interactive=True, file=out)
    bar.on_train_start(trainer, None)
    for micro in range(4):  # 2 accumulation micro-batches per optimizer step
        trainer.global_step = 50 + (micro + 1) // 2
        trainer.progress_bar_metrics = {"loss": 3.25, "tok/s": 41234.0}
        bar.on_train_batch_end(trainer, None, None, None, micro)
    bar.on_train_end(trainer, None)
    frames = out.getvalue().split("\r")
    assert frames[1].startswith("step 50/100 |")
    counts = [f.split(" |")[0] for f in frames if f.startswith("step")]
    assert sorted(set(counts)) == ["step 50/100", "step 51/100", "step 52/100"]  # redrawn, never 53 or 100+
    assert "loss 3.2500 · 41.2k train tok/s" in frames[-1] and "ETA " in frames[-1]

    # No terminal: plain log lines, at the first step and the last at least.
    trainer.global_step = 0
    bar = StepProgressBar(interactive=False)
    with caplog.at_level(logging.INFO, logger="callbacks.progress"):
        bar.on_train_start(trainer, None)
        for step in range(1, 101):
            trainer.global_step = step
            bar.on_train_batch_end(trainer, None, None, None, step)
        bar.on_train_end(trainer, None)
    lines = [r.getMessage() for r in caplog.records if r.name == "callbacks.progress"]
    assert lines[0].startswith("step 1/100 · loss 3.2500") and lines[-1].startswith("step 100/100 ·")
    assert len(lines) == 2 and lines[-1].endswith("ETA 00:00")


class CountingTrainer(SimpleNamespace):
    """A trainer whose prog_bar metrics count their reads: each converts the module's device tensors."""

    reads = 0

    @property
    def progress_bar_metrics(self) -> dict:
        self.reads += 1
        return {"loss": 3.25}


def test_the_bar_reads_the_metrics_only_where_the_module_logs_new_ones() -> None:
    """Drawn every step, the bar reads the metrics at the first and last steps and every log_every_n_steps,
    where the module logs: not at every step, which would make the host wait for the device every step."""
    trainer = CountingTrainer(max_steps=30, global_step=0, sanity_checking=False, log_every_n_steps=10)
    bar = StepProgressBar(interactive=True, file=io.StringIO())
    bar.on_train_start(trainer, None)
    for step in range(1, 31):
        trainer.global_step = step
        bar.on_train_batch_end(trainer, None, None, None, step)
    assert trainer.reads == 4  # steps 1, 10, 20, 30


def test_the_bar_shows_the_modules_console_figures_and_lightnings_validation_loss() -> None:
    """LitGPT's loss and rate are host values on the module (``console_metrics``, read at its reports: logged
    with prog_bar=True, Lightning would read them back from the device after every batch); the validation
    loss still comes from Lightning's prog_bar metrics."""
    trainer = SimpleNamespace(max_steps=10, global_step=0, progress_bar_metrics={"val/loss": 3.5},
                              sanity_checking=False, log_every_n_steps=1)
    module = SimpleNamespace(console_metrics={"loss": 3.25, "tok/s": 41234.0}, validated_at=4)
    out = io.StringIO()
    bar = StepProgressBar(interactive=True, file=out)
    bar.on_train_start(trainer, module)
    trainer.global_step = 1
    bar.on_train_batch_end(trainer, module, None, None, 0)
    bar.on_train_end(trainer, module)
    assert "loss 3.2500 · val/loss 3.5000 (step 4) · 41.2k train tok/s" in out.getvalue()


def test_quiet_lightning_drops_the_listed_messages_and_nothing_else() -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_lightning()
            quiet_lightning()  # idempotent
            for message in (
                "The `srun` command is available on your system but is not used. HINT: srun python train.py",
                "The number of training batches (4) is smaller than the logging interval Trainer(...)",
                "You're resuming from a checkpoint that ended before the epoch ended and your "
                "dataloader is ...",
                "Some other hint",
            ):
                warnings.warn(message, PossibleUserWarning, stacklevel=1)
            warnings.warn(
                "`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1
            )
            warnings.warn("Some other deprecation", FutureWarning, stacklevel=1)
            for line in (
                "GPU available: False, used: False",
                "TPU available: False, using: 0 TPU cores",
                "💡 Tip: try installing [litlogger]",
                "Restored all states from the checkpoint",
            ):
                rank_zero_info(line)
    finally:
        rank_zero_logger.removeHandler(handler)
    assert [str(w.message) for w in caught] == ["Some other hint", "Some other deprecation"]
    assert records == ["Restored all states from the checkpoint"]


def test_a_run_prints_steps_loss_and_throughput_and_no_lightning_noise(tmp_path: Path) -> None:
    """4 optimizer steps of 2 micro-batches; srun on PATH and log_every above the batch count provoke the
    hints that quiet_lightning() drops."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    run = run_train(
        tmp_path / "run",
        "trainer.enable_progress_bar=true",
        "max_steps=4",
        "micro_batch=4",  # global_batch 8: 2 accumulation micro-batches per step
        "log_every=50",
        "val_every=2",
        "val_sequences=8",
        "checkpoint.steps=[4]",
        env={"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"},
    )
    console = run.stdout + run.stderr
    counts = [(int(k), int(n)) for k, n in re.findall(r"\bstep (\d+)/(\d+)\b", console)]
    assert counts and {n for _, n in counts} == {4} and max(k for k, _ in counts) == 4, console
    assert re.search(
        r"step 4/4 · loss \d+\.\d{4} · val/loss \d+\.\d{4} \(step 4\) · [\d.]+[kMG]? train tok/s · "
        r"\d+:\d\d elapsed · "
        r"ETA 00:00",
        console,
    ), console
    assert re.search(
        r"run summary: step 4/4 \(finished\) · train loss \d+\.\d{4} · val loss \d+\.\d{4} \(step 4\)",
        console,
    )
    assert "model: " in console and "accumulation 2 x micro_batch 4 x world size 1" in console
    assert "run directory:" in console and "probe at step 0" in console
    for noise in (
        "Epoch 0/",
        "v_num",
        "Total FLOPs",
        "litlogger",
        "LeafSpec",
        "GPU available",
        "TPU available",
        "srun",
        "smaller than the logging interval",
    ):
        assert noise not in console, noise
    # Runs without the FAST overrides get no model summary table either.
    assert OmegaConf.load(ROOT / "conf" / "train" / "trainer" / "default.yaml").enable_model_summary is False
