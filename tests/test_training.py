"""Real training runs (real Trainer, real tiktoken, real files) in subprocesses, as a user runs them."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from callbacks.checkpointing import AtomicCheckpointIO, ScheduledCheckpoint
from models.gpt import GPTConfig
from models.lit import LitGPT, warmup_cosine
from models.pretrained import load_checkpoint
from normgeo.config.schema import OptimSchema
from normgeo.measure.mean_sources import BUCKET_STARTS, DOC_START
from normgeo.measure.records import read_rows
from normgeo.run_folder import MEAN_SOURCES_FILE, REPLACED_DIR
from tests.conftest import (
    entry_point_here,
    metrics_rows,
    module_main,
    run_train,
    step_losses,
    train_here,
    train_in_process,
)
from tests.test_run_state import schedule_of


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def accumulated_run(tmp_path_factory) -> Path:
    """6 steps, micro batch 2 of a global batch 8 (4 accumulation micro-steps), checkpoints at 2 and 5
    (and at the final step 6, which every schedule ends with); 500 probe tokens: 7 windows of 64 and a
    52-token tail."""
    run_dir = tmp_path_factory.mktemp("acc") / "run"
    train_here(run_dir, "micro_batch=2", "max_steps=6", "checkpoint.steps=[2,5]", "checkpoint.last_every=0",
               "probe.tokens=500", "probe.figures=true")
    return run_dir


# The single-process reference of the DDP and compiled tests: 3 steps, micro batch 2, checkpoint at 3.
SINGLE = ["max_steps=3", "checkpoint.steps=[3]", "micro_batch=2"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    """The SINGLE run, eager in one process: trained once for the module (both tests compare against it)."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train_here(run_dir, *SINGLE)
    return run_dir


@pytest.mark.slow
def test_schedule_fires_at_exactly_the_listed_optimizer_steps(accumulated_run: Path) -> None:
    ckpts = sorted(p.name for p in (accumulated_run / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step-0000002.ckpt", "step-0000005.ckpt", "step-0000006.ckpt"]
    assert load(accumulated_run / "checkpoints" / "step-0000002.ckpt")["global_step"] == 2
    assert load(accumulated_run / "checkpoints" / "step-0000005.ckpt")["global_step"] == 5
    assert load(accumulated_run / "checkpoints" / "last.ckpt")["global_step"] == 6


def test_scheduled_checkpoints_keep_weights_only_and_last_keeps_everything(accumulated_run: Path) -> None:
    scheduled = load(accumulated_run / "checkpoints" / "step-0000005.ckpt")
    last = load(accumulated_run / "checkpoints" / "last.ckpt")
    assert "optimizer_states" not in scheduled and "state_dict" in scheduled
    assert last["optimizer_states"] and last["lr_schedulers"] and "rng" in last
    assert last["gpt_config"]["norm"] == "layer"


def test_probe_records_at_init_and_each_scheduled_step(accumulated_run: Path) -> None:
    rows = read_rows(accumulated_run / "angles.jsonl")
    assert sorted({r["step"] for r in rows}) == [0, 2, 5, 6]
    per_step = 3 * (2 * 2 * 3 + 3)  # refs x (layers x {ln1,ln2} + final) x {in,std,out}
    assert all(sum(r["step"] == s for r in rows) == per_step for s in (0, 2, 5, 6))
    assert {r["tokens_seen"] for r in rows if r["step"] == 5} == {5 * 8 * 64}
    assert all(r["count"] == 500 for r in rows)  # probe.tokens=500: every token counted, the tail too
    figures = sorted(p.name for p in (accumulated_run / "figures").iterdir())
    assert any(name.startswith("layers_") for name in figures) and any(
        name.startswith("steps_") for name in figures
    )


def test_mean_sources_at_every_probe_and_none_when_off(accumulated_run: Path, tmp_path: Path, capfd) -> None:
    """probe.mean_sources (on by default): mean_sources.jsonl at every probe and its figure; off, the same
    training writes neither. That run also leaves its figures to later (probe.figures=false): none at its
    end, and normgeo.report draws them from its records."""
    rows = read_rows(accumulated_run / MEAN_SOURCES_FILE)
    # norm inputs x (dimensions row + a row per bucket + the document starts')
    per_step = (2 * 2 + 1) * (2 + len(BUCKET_STARTS))
    assert [sum(r["step"] == s for r in rows) for s in (0, 2, 5, 6)] == [per_step] * 4
    # The training probe knows its documents (GPT-2's end-of-text between them): the stream opens with one.
    starts = [r["count"] for r in rows if r["kind"] == "position" and r["bucket"] == DOC_START]
    assert len(starts) == 4 * (2 * 2 + 1) and min(starts) >= 1
    assert all(r["count"] == 500 for r in rows if r["kind"] == "dimensions")
    assert list((accumulated_run / "figures").glob("mean_sources_*.png"))
    off = tmp_path / "off"
    train_here(off, "max_steps=1", "checkpoint.steps=[1]", "probe.tokens=500", "probe.intervention=[]",
               "probe.mean_sources=false")
    assert len({r["step"] for r in read_rows(off / "angles.jsonl")}) == 2
    assert not (off / MEAN_SOURCES_FILE).exists()
    assert not (off / "figures").exists() and json.loads((off / "summary.json").read_text())["figures"] == []
    drawn = module_main(capfd, "report", off)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert list((off / "figures").glob("layers_*.png")) and not list((off / "figures").glob("mean_sources_*"))


@pytest.mark.slow
def test_analyze_of_a_checkpoint_gives_the_training_probe_records(
    accumulated_run: Path, tmp_path: Path
) -> None:
    """One measurement pipeline: analyze.py on the step-5 checkpoint, with the run's probe tokens,
    writes exactly the records (counts, tokens_seen, every number) the training probe wrote at step 5."""
    ckpt = accumulated_run / "checkpoints" / "step-0000005.ckpt"
    done = entry_point_here(
        "analyze",
        [
            "model=checkpoint",
            f"model.checkpoint={ckpt}",
            "model.name=normgeo-tiny",
            "probe=pydoc",
            "probe.tokens=500",
            f"out_dir={tmp_path / 'out'}",
            "progress=false",
        ],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trained = [r for r in read_rows(accumulated_run / "angles.jsonl") if r["step"] == 5]
    analyzed = read_rows(tmp_path / "out" / "angles.jsonl")
    assert len(analyzed) == 45 and {r["count"] for r in analyzed} == {500}
    assert analyzed == trained
    trained_null = [r for r in read_rows(accumulated_run / "null.jsonl") if r["step"] == 5]
    assert read_rows(tmp_path / "out" / "null.jsonl") == trained_null
    # Both know where the probe's documents start (the checkpoint's end-of-text): the same doc_start rows.
    trained_sources = [r for r in read_rows(accumulated_run / MEAN_SOURCES_FILE) if r["step"] == 5]
    analyzed_sources = read_rows(tmp_path / "out" / MEAN_SOURCES_FILE)
    assert analyzed_sources == trained_sources
    assert all(r["count"] > 0 for r in analyzed_sources if r.get("bucket") == DOC_START)


def test_losses_are_logged_once_per_optimizer_step(accumulated_run: Path) -> None:
    losses = step_losses(accumulated_run)
    assert sorted(losses) == list(range(1, 7))  # the k-th update at step k, like its probe and checkpoint
    assert all(0 < loss < 12 for loss in losses.values())
    # Beside each loss, the learning rate that update used: the schedule's value after k - 1 steps.
    optim = yaml.safe_load((accumulated_run / "run_config.yaml").read_text())["optim"]
    rows = metrics_rows(accumulated_run)
    lrs = {int(row["step"]): float(row["train/lr"]) for row in rows if row.get("train/lr")}
    assert lrs == {
        k: pytest.approx(optim["lr"] * warmup_cosine(k - 1, warmup_steps=0, max_steps=6,
                                                     min_lr_ratio=optim["min_lr_ratio"]))
        for k in range(1, 7)
    }


@pytest.mark.slow
def test_stop_and_resume_reproduces_the_uninterrupted_run_exactly(tmp_path: Path, capsys) -> None:
    common = ["max_steps=8", "checkpoint.steps=[3,6]", "checkpoint.last_every=1"]
    whole = tmp_path / "whole"
    train_here(whole, *common)
    split = tmp_path / "split"
    train_here(split, *common, "stop_at_step=4")
    assert load(split / "checkpoints" / "last.ckpt")["global_step"] == 4
    refused = train_in_process(split, *common, capsys=capsys)
    assert refused.returncode == 2 and "resume=auto" in refused.stderr
    # A damaged records file of the run to resume is named before a step trains; nothing changes.
    records = (split / "null.jsonl").read_text()
    (split / "null.jsonl").write_text(records.replace('"mean_deg": ', '"mean_deg": "x", "was": ', 1))
    before = files_of(split)
    refused = train_in_process(split, *common, "resume=auto", capsys=capsys)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {split / 'null.jsonl'}:1: damaged record ('mean_deg' is 'x', expected a number); copy the "
        "file again from where the run wrote it, or remove that line to keep the other records"
    )
    assert files_of(split) == before
    (split / "null.jsonl").write_text(records)
    train_here(split, *common, "resume=auto")
    assert step_losses(split) == step_losses(whole)
    assert len(step_losses(whole)) == 8
    assert read_rows(split / "angles.jsonl") == read_rows(whole / "angles.jsonl")
    for name in ("step-0000003.ckpt", "step-0000006.ckpt", "last.ckpt"):
        a, b = (
            load(whole / "checkpoints" / name)["state_dict"],
            load(split / "checkpoints" / name)["state_dict"],
        )
        assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_ddp_two_cpu_processes_train_on_the_single_process_token_stream(
    single_run: Path, tmp_path: Path
) -> None:
    ddp = tmp_path / "ddp"
    run_train(ddp, *SINGLE, "trainer=ddp_cpu", "trainer.devices=2", "trainer.enable_progress_bar=false")
    single_losses, ddp_losses = step_losses(single_run), step_losses(ddp)
    assert sorted(ddp_losses) == [1, 2, 3]
    for step, loss in single_losses.items():
        # Same tokens, same weights: only the reduction order differs.
        assert ddp_losses[step] == pytest.approx(loss, rel=1e-5), step
    single_rows, ddp_rows = read_rows(single_run / "angles.jsonl"), read_rows(ddp / "angles.jsonl")
    assert len(single_rows) == len(ddp_rows)
    for a, b in zip(single_rows, ddp_rows, strict=True):
        assert a["count"] == b["count"] and b["mean_deg"] == pytest.approx(a["mean_deg"], abs=1e-3)


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_diverged_run_names_its_step_and_key_and_the_corrected_command_replaces_it(tmp_path: Path) -> None:
    """optim.lr=1e6 is in range but diverges: one line naming the step and optim.lr, exit 2, the folder marked
    diverged (summary.json); the same command again is refused with the corrected command, the folder as it
    was; the corrected command (a lower optim.lr) replaces the diverged run in the same folder, and puts it
    back whole (a 40 MiB file too) when it fails before its first step."""
    run_dir = tmp_path / "run"
    settings = ("max_steps=5", "checkpoint.last_every=1")
    diverged = train_here(run_dir, *settings, "optim.lr=1e6", check=False)
    assert diverged.returncode == 2, diverged.stderr[-3000:]
    last = diverged.stderr.strip().splitlines()[-1]
    assert re.match(
        r"error: training diverged: the training loss is nan at step \d; the likely cause is the learning "
        r"rate, optim.lr=1e\+06: lower it .*is marked diverged in summary.json",
        last,
    ), last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["diverged"]["lr"] == 1e6 and summary["session_log"][-1]["ended"] == "diverged"
    # No checkpoint holds the diverged weights: last.ckpt is the last finite step's, if any.
    assert all(torch.isfinite(t).all() for t in torch.load(run_dir / "checkpoints" / "last.ckpt",
                                                           weights_only=True)["state_dict"].values())
    # bigger than a byte copy's old 16 MiB limit
    with open(run_dir / "checkpoints" / "big-40mib.bin", "wb") as big:
        big.truncate(40 * 2**20)
    before = files_of(run_dir)
    again = train_here(run_dir, *settings, "optim.lr=1e6", check=False)
    assert again.returncode == 2
    assert "diverged at step" in again.stderr and "optim.lr=100000" in again.stderr.strip().splitlines()[-1]
    assert files_of(run_dir) == before
    # The corrected command failing before its first step (a logger under a file) puts the diverged run back.
    (tmp_path / "a-file").write_text("x")
    broken = [
        "+logger.extra._target_=lightning.pytorch.loggers.CSVLogger",
        f"+logger.extra.save_dir={tmp_path / 'a-file'}",
    ]
    failed = train_here(run_dir, *settings, "optim.lr=1e-3", *broken, check=False)
    assert failed.returncode == 1 and "replaced the run that diverged" in failed.stderr + failed.stdout
    assert files_of(run_dir) == before
    corrected = train_here(run_dir, *settings, "optim.lr=1e-3")
    assert "replaced the run that diverged" in corrected.stderr + corrected.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "diverged" not in summary and summary["finished"] and summary["sessions"] == 1
    assert [p.name for p in (run_dir / "csv").iterdir()] == ["version_0"]
    assert not (run_dir / REPLACED_DIR).exists()  # the replaced run, deleted at the first optimizer step


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("norm=foo", ["layer", "rms"]),
        ("size=3b", ["1b", "410m", "70m", "tiny"]),
        ("trainer=tpu", ["ddp", "fsdp"]),
    ],
)
@pytest.mark.slow
def test_unknown_options_list_the_valid_ones(
    tmp_path: Path, override: str, expected: list[str], capsys
) -> None:
    result = train_in_process(tmp_path / "bad", override, capsys=capsys)
    assert result.returncode != 0
    assert all(choice in result.stderr for choice in expected), result.stderr[-2000:]


@pytest.mark.slow
def test_missing_openwebtext_names_the_prepare_command(tmp_path: Path, capsys) -> None:
    result = train_in_process(tmp_path / "owt", "data=openwebtext", capsys=capsys)
    assert result.returncode == 2
    assert "python -m corpus data=openwebtext" in result.stderr


@pytest.mark.slow
def test_truncated_training_data_is_refused_before_training(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "first"
    train_here(run_dir, "max_steps=1", "probe.enabled=false")
    train_bin = tmp_path / "data" / "pydoc" / "train.bin"
    with open(train_bin, "r+b") as handle:
        handle.truncate(train_bin.stat().st_size // 2)
    result = train_in_process(tmp_path / "second", "max_steps=1", "probe.enabled=false", capsys=capsys)
    assert result.returncode == 2 and "truncated" in result.stderr
    assert not (tmp_path / "second" / "checkpoints").exists()


def test_hydra_config_is_saved_with_the_run(accumulated_run: Path) -> None:
    config = (accumulated_run / ".hydra" / "config.yaml").read_text()
    assert "micro_batch: 2" in config
    hparams = json.dumps((accumulated_run / "csv" / "version_0" / "hparams.yaml").read_text())
    assert "global_batch" in hparams


@pytest.mark.slow
def test_compiled_model_trains_like_eager_under_ddp_and_probes(single_run: Path, tmp_path: Path) -> None:
    """compile=true (torch.compile, inductor on CPU) under 2-process DDP is a speed switch: same losses
    and probe records as the eager single-process run (DDP equals one process: test above)."""
    compiled_run = run_train(
        tmp_path / "compiled", *SINGLE, "compile=true", "trainer=ddp_cpu", "trainer.devices=2"
    )
    assert "torch.compile: model compiled" in compiled_run.stdout + compiled_run.stderr
    eager, compiled = step_losses(single_run), step_losses(tmp_path / "compiled")
    assert sorted(compiled) == [1, 2, 3]
    assert all(compiled[step] == pytest.approx(loss, rel=1e-4) for step, loss in eager.items())
    eager_rows, compiled_rows = (
        read_rows(single_run / "angles.jsonl"),
        read_rows(tmp_path / "compiled" / "angles.jsonl"),
    )
    assert len(compiled_rows) == len(eager_rows) == 2 * 3 * 15  # steps x refs x (5 norms x {in, std, out})
    for a, b in zip(eager_rows, compiled_rows, strict=True):
        assert (a["step"], a["site"], a["count"]) == (b["step"], b["site"], b["count"])
        assert b["mean_deg"] == pytest.approx(a["mean_deg"], abs=1e-3)
    state = load(tmp_path / "compiled" / "checkpoints" / "last.ckpt")["state_dict"]
    assert not any("_orig_mod" in name for name in state)  # checkpoints load with or without compile


def largest_difference(a: object, b: object) -> float:
    """The largest |a - b| / max(1, |a|) over two records' numbers; inf where anything else differs."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return math.inf
        return max((largest_difference(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return max(map(largest_difference, a, b), default=0.0) if len(a) == len(b) else math.inf
    if isinstance(a, float) and isinstance(b, float | int) and not isinstance(b, bool):
        return 0.0 if a == b else abs(a - b) / max(1.0, abs(a))  # nan == nan is not a difference here
    return 0.0 if a == b or (a != a and b != b) else math.inf


@pytest.mark.slow
def test_a_compiled_run_stops_resumes_and_records_what_the_eager_run_does(tmp_path: Path) -> None:
    """Issue 61, item 1: compile=true (inductor on the CPU here; compile=auto's choice on CUDA) with the
    probe on, stopped after step 1 and resumed compiled: the same records as the eager run, and checkpoints
    that load for the exports and analyze.py under the eager model's names. Tolerance (of max(1, |value|)):
    1e-4, as inductor sums float32 in another order (the weights and losses move by ~1e-7, the records by at
    most 5e-6); 2e-3 for intervention_positions.jsonl, whose KL shares divide KLs of ~1e-4 nats, the size of
    float32 rounding in the logits (measured: 6e-4). A probe that missed the norms (count 0), a lost step
    or a wrong resume is off by far more (the loss falls by 2e-3 of itself a step)."""
    common = ["max_steps=2", "checkpoint.steps=[1]", "checkpoint.last_every=1", "probe.tokens=128",
              "probe.null_directions=4", "probe.bootstrap.replicates=20"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train_here(eager, *common)
    first = train_here(compiled, *common, "compile=true", "stop_at_step=1")
    assert "torch.compile: model compiled" in first.stdout + first.stderr
    train_here(compiled, *common, "compile=true", "resume=auto")
    losses = step_losses(compiled)
    assert sorted(losses) == [1, 2]
    assert max(largest_difference(a, losses[step]) for step, a in step_losses(eager).items()) < 1e-4
    records = sorted(p.name for p in eager.glob("*.jsonl"))
    assert {"angles.jsonl", "null.jsonl", "intervention.jsonl", MEAN_SOURCES_FILE} <= set(records)
    assert records == sorted(p.name for p in compiled.glob("*.jsonl"))
    for name in records:
        a, b = read_rows(eager / name), read_rows(compiled / name)
        assert sorted({r["step"] for r in b}) == [0, 1, 2], name
        assert largest_difference(a, b) < (2e-3 if name == "intervention_positions.jsonl" else 1e-4), name
    for name in ("step-0000001.ckpt", "last.ckpt"):
        state = load(compiled / "checkpoints" / name)["state_dict"]
        assert state.keys() == load(eager / "checkpoints" / name)["state_dict"].keys()  # no _orig_mod.
        model, step, _ = load_checkpoint(compiled / "checkpoints" / name)  # what export.py and analyze read
        assert step == load(compiled / "checkpoints" / name)["global_step"] and model.config.n_embd == 32


@pytest.mark.slow
def test_bf16_mixed_trains_the_smoke_experiment_and_probes_in_float32(tmp_path: Path) -> None:
    """bf16 autocast on CPU: the model runs in bf16, the probe's angles are still computed in float32."""
    common = ["experiment=smoke", "max_steps=3", "optim.warmup_steps=0", "checkpoint.steps=[3]"]
    train_here(tmp_path / "fp32", *common)
    train_here(tmp_path / "bf16", *common, "trainer.precision=bf16-mixed")
    fp32, bf16 = step_losses(tmp_path / "fp32"), step_losses(tmp_path / "bf16")
    assert sorted(bf16) == [1, 2, 3]
    # bf16 keeps 8 bits of mantissa: the losses agree to a few parts in a thousand, not to float32 rounding.
    assert all(
        bf16[step] == pytest.approx(loss, rel=1e-2) and bf16[step] != loss for step, loss in fp32.items()
    )
    rows = {
        (r["step"], r["layer"], r["site"], r["ref"]): r for r in read_rows(tmp_path / "bf16" / "angles.jsonl")
    }
    reference = read_rows(tmp_path / "fp32" / "angles.jsonl")
    assert len(rows) == len(reference) == 2 * 3 * 15  # steps x refs x (5 norms x {in, std, out})
    for a in reference:
        b = rows[(a["step"], a["layer"], a["site"], a["ref"])]
        assert b["count"] == a["count"] and b["mean_deg"] == pytest.approx(a["mean_deg"], abs=0.5)
        if a["site"].endswith(".out") and a["ref"] == "ones":
            # LayerNorm's output is orthogonal to 1 up to its gain and bias, and the probe casts every
            # vector to float32 before the angle: the bf16 run still measures it within 0.05 deg of 90.
            assert abs(b["mean_deg"] - 90.0) < 0.05 and b["std_deg"] < 0.05, b


@pytest.fixture(scope="module")
def counted_run(tmp_path_factory) -> tuple[Path, list[tuple[str, int]]]:
    """4 steps, last.ckpt every 3 and the schedule's final step 4, with a configured CSVLogger into the folder
    every run's own CSV uses (as older logger configs name it); every checkpoint write recorded (file, step)
    on its way through the real checkpoint IO."""
    run_dir = tmp_path_factory.mktemp("counted") / "run"
    written: list[tuple[str, int]] = []
    save = AtomicCheckpointIO.save_checkpoint

    def recording_save(self, checkpoint, path, storage_options=None) -> None:
        written.append((Path(path).name, checkpoint["global_step"]))
        save(self, checkpoint, path, storage_options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AtomicCheckpointIO, "save_checkpoint", recording_save)
        train_here(
            run_dir,
            "max_steps=4",
            "checkpoint.steps=[2]",
            "checkpoint.last_every=3",
            "probe.enabled=false",
            "log_every=1",
            "+logger.old_csv._target_=lightning.pytorch.loggers.CSVLogger",
            f"+logger.old_csv.save_dir={run_dir}",
            "+logger.old_csv.name=csv",
        )
    return run_dir, written


def test_the_final_steps_full_state_is_written_once(counted_run: tuple[Path, list[tuple[str, int]]]) -> None:
    """last.ckpt holds the full state (a 1b run's is 12 GB): refreshed at each scheduled step, at its interval
    and at the final step, and not once more when training ends."""
    _, written = counted_run
    assert [w for w in written if w[0] == "last.ckpt"] == [
        ("last.ckpt", 2),
        ("last.ckpt", 3),
        ("last.ckpt", 4),
    ]
    assert [w for w in written if w[0] != "last.ckpt"] == [("step-0000002.ckpt", 2), ("step-0000004.ckpt", 4)]


def test_a_configured_csv_logger_into_the_runs_csv_folder_is_not_a_second_writer(
        counted_run: tuple[Path, list[tuple[str, int]]]) -> None:
    run_dir, _ = counted_run
    assert [p.name for p in (run_dir / "csv").iterdir()] == ["version_0"]
    assert sorted(step_losses(run_dir)) == [1, 2, 3, 4]
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as handle:
        steps = [row["step"] for row in csv.DictReader(handle) if row.get("train/loss")]
    assert len(steps) == len(set(steps)) == 4  # one row per logged step: a second CSVLogger would repeat them


class SessionTime(L.Callback):
    """A clock that the test moves: 45 s of wall time per optimizer step (so a 1-minute trigger fires at every
    other step), and the steps at which a checkpoint was saved."""

    def __init__(self) -> None:
        self.now = 0.0
        self.saved: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.now = 45.0 * trainer.global_step  # before the owner's hook (it comes after this in the list)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        self.saved.append(trainer.global_step)


def test_last_ckpt_is_also_refreshed_every_n_minutes(tmp_path: Path) -> None:
    """checkpoint.every_minutes, the time trigger of the one checkpoint owner: last.ckpt again once that many
    minutes have passed since the last one (rank 0's clock, broadcast), on a real Trainer and LitGPT."""
    time_ = SessionTime()
    schedule = schedule_of(6, steps=[6], last_every=0, every_minutes=1.0)
    owner = ScheduledCheckpoint(str(tmp_path / "checkpoints"), schedule, clock=lambda: time_.now)
    module = LitGPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64),
                    OptimSchema(lr=1e-3, warmup_steps=0), seed=0, max_steps=6, global_batch=2)
    window = (torch.arange(8), torch.arange(1, 9))
    data = torch.utils.data.DataLoader([window] * 12, batch_size=2)
    trainer = L.Trainer(max_steps=6, callbacks=[time_, owner], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, data)
    # 45 s a step: 60 s have passed at steps 2 (90 s) and 4 (180 - 90 s); step 6 is scheduled. (The scheduled
    # weights-only file calls no callback hook: one entry for step 6, its last.ckpt.)
    assert time_.saved == [2, 4, 6]
    off = schedule_of(6, steps=[6], last_every=0)
    assert off.every_minutes is None


@pytest.mark.slow  # a process of its own: inductor finds its C++ compiler once per process
def test_compile_true_where_torch_compile_cannot_run_is_refused_at_the_start(tmp_path: Path) -> None:
    """compile=true is refused before anything is written where inductor has no C++ compiler (compile=auto
    would train eagerly there)."""
    no_compiler = {"CXX": str(tmp_path / "no-such-g++")}
    done = run_train(tmp_path / "run", "compile=true", check=False, env=no_compiler)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "compile=true: torch.compile needs a C++ compiler for CPU kernels and none works here (install g++ "
        "or set CXX); or compile=auto (eager where it cannot compile)"
    ) in done.stderr
    assert not (tmp_path / "run").exists()
