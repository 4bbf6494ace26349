"""The memory and compute plan (models/step_cost.py, python -m normgeo.plan) against real steps and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from models.gpt import GPTConfig
from models.lit import LitGPT
from models.step_cost import (
    GIB,
    TrainSetup,
    gate,
    gate_plan,
    largest_micro_batch,
    make_plan,
    measure_step,
    model_counts,
    per_gpu,
    quiet_plan,
    trace_compiled_step,
    trace_step,
    traced_gate_plan,
)
from normgeo.config.checks import group_options
from normgeo.config.compose import TRAIN_CONFIG_DIRS
from normgeo.config.schema import OptimSchema
from normgeo.plan import compose, measured_overrides, measured_peaks
from normgeo.plan import main as plan_main
from normgeo.runs.preflight import PlanRefusal, preflight, setup_from_config
from tests.conftest import FAST, ROOT, entry_point_here, train_here

OPTIM = OptimSchema(lr=1e-3, warmup_steps=1000)
SIZES = {  # small contexts and batches: a real CPU step in seconds
    "tiny": dict(n_layer=2, n_head=2, n_embd=128),
    "70m": dict(n_layer=6, n_head=8, n_embd=512),
}


def setup_of(size: str, seq_len: int = 64, micro_batch: int = 2, global_batch: int = 8,
             **kwargs) -> TrainSetup:
    model = GPTConfig(**SIZES[size], block_size=seq_len, norm="layer", tie_embeddings=False)
    # What train.py runs on the CPU: fp32, one device, LitGPT's unfused AdamW.
    return TrainSetup(model=model, optim=OPTIM, micro_batch=micro_batch, global_batch=global_batch,
                      precision="32-true", strategy="single", fused_adamw=False, **kwargs)


def real_step_peak(setup: TrainSetup) -> int:
    """MemTracker's peak over a real steady-state step on real CPU tensors (not the planner's code)."""
    torch.manual_seed(0)
    module = LitGPT(setup.model, setup.optim, seed=0, max_steps=10, global_batch=8)
    optimizer = module.configure_optimizers()["optimizer"]
    batch = torch.randint(0, 50257, (setup.micro_batch, setup.seq_len + 1))
    for _ in range(2):  # the first step creates the optimizer state; the second is the steady state
        tracker = MemTracker()
        tracker.track_external(module, optimizer)
        with tracker:
            loss = module.training_step((batch[:, :-1], batch[:, 1:]), 0)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("size", ["tiny", pytest.param("70m", marks=pytest.mark.slow)])
def test_planned_peak_agrees_with_a_real_step_within_10_percent(size: str) -> None:
    setup = setup_of(size, global_batch=2)  # one micro-step per optimizer step, as the real step runs
    with quiet_plan():
        planned = trace_step(setup, setup.micro_batch, checkpointing=False).peak["Total"]
    real = real_step_peak(setup)
    print(f"{size}: planned {planned / 2**20:.1f} MiB, real {real / 2**20:.1f} MiB")
    assert abs(planned - real) <= 0.10 * real


@pytest.mark.parametrize("size,compiled", [("tiny", False), ("70m", False), ("tiny", True)])
def test_counted_flops_agree_with_6n_plus_12ltd_within_5_percent(size: str, compiled: bool) -> None:
    setup = setup_of(size, seq_len=256, compiled=compiled)  # compiled: counted on the partitioned graphs
    with quiet_plan():
        plan = make_plan(setup, both_checkpointing=False, probe=False)
    counted, analytic = plan.configured.flops_per_token, plan.analytic_flops_per_token
    print(f"{size}: counted {counted:.4g}, analytic {analytic:.4g} FLOPs per token")
    assert abs(counted - analytic) <= 0.05 * analytic


@pytest.mark.slow
def test_checkpoint_sizes_agree_with_the_files_a_smoke_run_writes(tmp_path: Path) -> None:
    overrides = ["max_steps=2", "checkpoint.steps=[1]", "checkpoint.last_every=0", "probe.enabled=false"]
    run_dir = tmp_path / "run"
    train_here(run_dir, *overrides)
    from normgeo.plan import checkpoint_disk, compose
    from normgeo.runs.preflight import setup_from_config

    cfg = compose([*FAST, f"run_dir={run_dir}", *overrides])
    with quiet_plan():
        plan = make_plan(setup_from_config(cfg), both_checkpointing=False, probe=False)
    disk = checkpoint_disk(cfg, plan)
    files = run_dir / "checkpoints"
    scheduled = [files / "step-0000001.ckpt", files / "step-0000002.ckpt"]
    assert disk["checkpoints"] == len(scheduled)
    for path in scheduled:
        assert abs(path.stat().st_size - disk["scheduled_bytes"]) <= 0.01 * path.stat().st_size
    last = (files / "last.ckpt").stat().st_size
    print(f"planned {disk['scheduled_bytes']:,} / {disk['last_bytes']:,} B, files "
          f"{[p.stat().st_size for p in scheduled]} / {last:,} B")
    assert abs(last - disk["last_bytes"]) <= 0.01 * last
    actual_total = sum(p.stat().st_size for p in files.glob("*.ckpt"))
    assert abs(actual_total - disk["total_bytes"]) <= 0.01 * actual_total


def test_activation_checkpointing_lowers_the_peak_and_the_peak_grows_with_micro_batch() -> None:
    setup = setup_of("tiny", seq_len=128, micro_batch=4)
    with quiet_plan():
        plan = make_plan(setup, probe=False)
    off, on = plan.plans[False], plan.plans[True]
    assert on.memory.activations < off.memory.activations
    assert on.flops_per_token > off.flops_per_token  # the recomputed forward
    assert off.peak.per_sample > 0 and off.peak.at(4) == pytest.approx(off.memory.total, rel=1e-6)


def test_fsdp2_shards_the_state_over_ranks() -> None:
    base = dict(optim=OPTIM, micro_batch=2, global_batch=8, world_size=4, precision="bf16-mixed",
                fused_adamw=True)
    model = setup_of("tiny").model
    ddp = TrainSetup(model=model, strategy="ddp", **base)
    fsdp = TrainSetup(model=model, strategy="fsdp2", **base)
    with quiet_plan():
        d = make_plan(ddp, both_checkpointing=False, probe=False).configured.memory
        f = make_plan(fsdp, both_checkpointing=False, probe=False).configured.memory
    assert f.optimizer == pytest.approx(d.optimizer / 4, abs=8)
    assert f.total < d.total


def test_the_gate_warns_between_its_lower_bound_and_the_plan_and_refuses_below_the_bound() -> None:
    setup = setup_of("tiny", seq_len=128, micro_batch=8)
    with quiet_plan():
        plan = make_plan(setup, both_checkpointing=False, probe=False)
    planned = gate_plan(plan)
    peak, least = planned.peak, planned.lower_bound
    assert 0 < least < peak
    fits = gate(planned, peak + 2 * GIB, "Big GPU", headroom_gib=1.5, fragmentation=0.1)
    assert fits.refusal is None and fits.warning is None
    # Between the lower bound and the plan: the run starts, with the numbers.
    between = int((least + peak) / 2 + 1.5 * GIB)
    warned = gate(planned, between, "Mid GPU", headroom_gib=1.5, fragmentation=0.1)
    assert warned.refusal is None and "Mid GPU" in warned.warning and "eager plan's peak" in warned.warning
    # Below the bound: refused, one line naming the plan, the card and the micro_batch that fits.
    small = int(plan.configured.peak.at(2) * 1.1 + 1.5 * GIB) + 1
    assert least + 1.5 * GIB > small  # the tiny model's state is small beside its logits
    message = gate(gate_plan(plan), small, "Small GPU", headroom_gib=1.5, fragmentation=0.1).refusal
    assert message is not None and "\n" not in message
    best = largest_micro_batch(plan.configured.peak, small, 8, 1, 1.5, 0.1)
    assert best == 2 and "micro_batch=2 fits the plan" in message and "Small GPU" in message
    assert f"{peak / GIB:.1f} GiB" in message and "plan.check=false" in message


def test_the_gate_traces_a_second_micro_batch_only_for_a_run_that_does_not_fit() -> None:
    """The launch gate's plan (train.py's start waits for it): one trace where the peak fits the card, the
    plan's numbers at the configured micro_batch; where it does not, the second trace gives the same line as
    the full plan, from which the gate names the micro_batch that fits."""
    setup = setup_of("tiny", seq_len=128, micro_batch=8)
    with quiet_plan():
        full = gate_plan(make_plan(setup, both_checkpointing=False, probe=False))
        roomy = traced_gate_plan(setup, full.peak + 2 * GIB, headroom_gib=1.5)
        small = int(full.peak / 2 + 1.5 * GIB)
        tight = traced_gate_plan(setup, small, headroom_gib=1.5)
    assert roomy.per_sample is None and roomy.fixed is None
    assert roomy == replace(full, fixed=None, per_sample=None)
    assert tight == full
    with pytest.raises(ValueError, match="one micro_batch"):
        roomy.line  # noqa: B018 (the property is what is tested)
    decision = gate(tight, small, "Small GPU", headroom_gib=1.5, fragmentation=0.1)
    line = decision.refusal or decision.warning
    best = largest_micro_batch(full.line, small, 8, 1, 1.5, 0.1)
    assert best is not None and f"micro_batch={best} fits the plan" in line, line


def test_accumulating_micro_steps_add_the_gradients_to_the_plan() -> None:
    """With global_batch = 4 x micro_batch the gradients live through every micro-step after the first: the
    plan grows by at least their bytes, compiled and eager (where the activations make the peak, as in
    every GPU configuration: without accumulation no gradient is alive there yet)."""
    for compiled in (False, True):
        with quiet_plan():
            single = make_plan(setup_of("tiny", 128, 4, global_batch=4, compiled=compiled),
                               both_checkpointing=False, probe=False)
            accumulating = make_plan(setup_of("tiny", 128, 4, global_batch=16, compiled=compiled),
                                     both_checkpointing=False, probe=False)
        grow = accumulating.configured.memory.total - single.configured.memory.total
        print(f"compiled={compiled}: +{grow:,} B for {single.counts.parameter_bytes:,} B of gradients")
        assert accumulating.configured.compiled is compiled
        assert grow >= single.counts.parameter_bytes


def test_the_compiled_plan_keeps_less_than_the_eager_trace_and_says_what_it_saved() -> None:
    """Inductor saves fewer tensors for the backward than eager autograd and fuses the pointwise chains: the
    compiled plan of a step whose activations make its peak is below the eager trace's."""
    setup = setup_of("tiny", 128, 4, global_batch=4)
    compiled = TrainSetup(**{**setup.__dict__, "compiled": True})
    with quiet_plan():
        eager = trace_step(setup, 4, checkpointing=False)
        planned = trace_compiled_step(compiled, 4)
    total = sum(planned.peak.values())
    print(f"eager {eager.get('Total') / 2**20:.1f} MiB, compiled {total / 2**20:.1f} MiB")
    assert total < eager.get("Total")
    assert 0 < planned.get("Activation") < eager.get("Activation")
    assert planned.flops == pytest.approx(eager.flops, rel=0.05)


def gpu_setup(row: dict) -> TrainSetup:
    return setup_from_config(compose(measured_overrides(row)))


@pytest.mark.slow
@pytest.mark.parametrize("row", measured_peaks(),
                         ids=lambda r: f"{r['size']}-{r['norm']}-mb{r['micro_batch']}-gb{r['global_batch']}")
def test_the_compiled_plan_is_within_10_percent_of_the_gpus_measured_peak(row: dict) -> None:
    """Issue 61: the plan of the compiled step against docs/measured_peaks.json (H200, torch 2.11): one
    compiled trace at the measured micro_batch (410m: ~45 s on an idle core)."""
    setup = gpu_setup(row)
    assert setup.compiled == row["compiled"] and setup.strategy == "single" and setup.fused_adamw
    start = time.perf_counter()
    with quiet_plan():
        trace = trace_compiled_step(setup, setup.micro_batch)
    planned = per_gpu(setup, model_counts(setup), trace, None).total
    ratio = planned / GIB / row["peak_gib"]
    print(f"{row['size']} {row['norm']}: planned {planned / GIB:.2f} GiB, measured {row['peak_gib']} GiB, "
          f"ratio {ratio:.3f} ({time.perf_counter() - start:.0f} s)")
    assert 0.90 <= ratio <= 1.10


GATE_CASES = {  # issue 61: the launch gate never refuses a run that fits (the device size stated)
    "70m-compiled-mb16-12GiB": (["size=70m", "micro_batch=16", "global_batch=16", "compile=true"], 12),
    "410m-compiled-mb32-48GiB": (["size=410m", "micro_batch=32", "global_batch=32", "compile=true"], 48),
    "410m-compiled-mb8-16GiB": (["size=410m", "micro_batch=8", "global_batch=8", "compile=true"], 16),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GATE_CASES))
def test_the_gate_starts_runs_that_fit(case: str, caplog) -> None:
    """train.py's pre-flight itself (normgeo.runs.preflight.preflight) with plan.device_memory_gib stating
    the card: it plans as the GPU run would (bf16-mixed, fused AdamW, one device, compiled), starts, and
    says nothing (H200 measurements: 70m mb16 4.49 GiB, 410m mb32 37.10 GiB)."""
    overrides, gib = GATE_CASES[case]
    cfg = compose([*overrides, "trainer=gpu", f"plan.device_memory_gib={gib}"])
    with caplog.at_level("WARNING"):
        kept = preflight(cfg)
    assert kept is not None and kept.plan.compiled and kept.plan.peak + 1.5 * GIB <= gib * GIB
    print(f"{case}: planned {kept.plan.peak / GIB:.2f} GiB, lower bound {kept.plan.lower_bound / GIB:.2f}")
    assert "plan:" not in caplog.text


@pytest.mark.slow
def test_the_gate_names_the_accumulated_gradients_of_an_eager_1b_run_on_24_gib(caplog) -> None:
    """1b, micro_batch 4 of 64 (16 micro-steps), compile=false, on 24 GiB: its fp32 gradients live through
    the micro-steps; the gate refuses or warns, naming them."""
    cfg = compose(["size=1b", "micro_batch=4", "global_batch=64", "compile=false", "trainer=gpu",
                   "plan.device_memory_gib=24"])
    with caplog.at_level("WARNING"):
        try:
            kept = preflight(cfg)
            message = caplog.text
        except PlanRefusal as err:
            kept, message = None, str(err)
    print(message)
    assert "accumulated over micro-steps" in message and "eager plan's peak" in message
    assert kept is None or not kept.plan.compiled


def run_plan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "normgeo.plan", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_the_command_prints_a_plan_and_writes_nothing(tmp_path: Path) -> None:
    result = run_plan("size=tiny", "seq_len=64", "micro_batch=4", "global_batch=8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "FLOPs per token" in result.stdout and "H100" in result.stdout and "disk:" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_plan_says_which_step_it_planned_and_measure_says_where_it_can_run(capsys) -> None:
    """Issue 50, item 4 and issue 61: a compiled run is planned compiled, and the report says which step it
    planned. --measure runs the real step where there is a CUDA device; here it names why it did not."""
    tiny = ["size=tiny", "seq_len=64", "micro_batch=4", "global_batch=8", "trainer=gpu"]
    assert plan_main([*tiny, "compile=true", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "the table plans the compiled step (models/compiled_plan.py" in out
    assert "(not measured: no CUDA device here" in out or "measured on " in out
    assert plan_main([*tiny, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # compile=auto (the default) as on the GPU planned for: compiled, wherever it is planned.
    assert report["compile"] is True and report["planned"] == "compiled"
    assert report["measured"] is None  # not asked: nothing run
    assert plan_main([*tiny, "--record"]) == 2  # --record records a measured step: with --measure
    setup = TrainSetup(model=GPTConfig(block_size=64), optim=OPTIM, micro_batch=1, global_batch=1)
    with pytest.raises(ValueError, match="measuring a step needs a CUDA device"):
        measure_step(setup, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("override", ["plan.gpus=[v100]", "plan.mfu=2", "trainer=nope", "micro_batch=3"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, override: str, capfd, monkeypatch) -> None:
    """normgeo.plan's main in this process, in an empty folder (what ``python -m normgeo.plan`` runs)."""
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert plan_main(["size=tiny", "seq_len=64", override]) == 2
    stderr = capfd.readouterr().err
    assert stderr.startswith("error: ") and stderr.strip().count("\n") == 0, stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override", ["size=70M", "norm=batch"])
def test_an_unknown_group_option_lists_the_choices_as_train_py_does(override: str, capfd) -> None:
    """Issue 64, class 5: ``python -m normgeo.plan size=70M`` names the options of the group, the line
    train.py prints (checks.unknown_group_option; before: Hydra's "Could not find 'size/70M'")."""
    capfd.readouterr()
    assert plan_main([override]) == 2
    stderr = capfd.readouterr().err
    group, option = override.split("=")
    options = group_options(group, TRAIN_CONFIG_DIRS)
    listed = ", ".join(options)
    assert stderr.strip() == f"error: {override}: no such option of {group}; choose from {listed}", stderr
    assert option not in options and "tiny" in group_options("size", TRAIN_CONFIG_DIRS)


@pytest.mark.slow
def test_train_py_plan_true_prints_the_1b_paper_plan_and_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    """``python train.py experiment=paper_1b plan=true`` (train.py's main, in this process, from an empty
    folder): the same plan as normgeo-plan, nothing trained or written (its time is printed, not asserted:
    about 15 s on 2 idle cores). test_the_command_prints_a_plan_and_writes_nothing runs a real process."""
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    result = entry_point_here("train", ["experiment=paper_1b", "plan=true"])
    print(f"train.py experiment=paper_1b plan=true: {time.perf_counter() - start:.1f} s")
    assert result.returncode == 0, result.stderr
    assert "FLOPs per token" in result.stdout and "H100" in result.stdout and "disk:" in result.stdout
    assert list(tmp_path.iterdir()) == []


# --- seeds a margin needs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--seeds-for", "val_loss=0.01"], ["--seeds-for", "nope=0.01", "--sd", "1"],
                                  ["--seeds-for", "val_loss=-1", "--sd", "1"], ["--sd", "0.1"],
                                  ["--seeds-for", "val_loss=0.01", "--sd", "0"]])
def test_seeds_for_bad_input_is_one_line_and_exit_2(args: list[str], capsys) -> None:
    from normgeo.plan import main

    assert main(["experiment=paper_70m", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --s"), err


@pytest.mark.slow
def test_seeds_for_a_margin_from_a_sweeps_paired_sd_with_gpu_hours(tmp_path: Path, capsys) -> None:
    """The SD of a sweep's LayerNorm − RMSNorm validation-loss differences, the seeds it needs at ±0.02 nats
    (statsmodels / the TOST power, checked against simulations in tests/test_verdict.py) and the GPU-hours."""
    import json
    import statistics

    from normgeo.measure.stats import seeds_for_difference, seeds_for_equivalence
    from normgeo.plan import main
    from tests.test_verdict import make_run

    diffs = [0.01, -0.02, 0.015, 0.03]
    for seed, diff in enumerate(diffs):
        for norm, loss in (("rms", 5.0), ("layer", 5.0 + diff)):
            run = make_run(tmp_path / "sweep", norm, seed, val_loss=loss, tokens_per_s=1000.0, dev=1.0)
            (run / ".hydra").mkdir()
            (run / ".hydra" / "config.yaml").write_text("max_steps: 10\n")
    tiny = ["size=tiny", "seq_len=64", "micro_batch=4", "global_batch=8"]
    assert main([*tiny, "--seeds-for", "val_loss=0.02", "--sweep", str(tmp_path / "sweep"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    seeds, sd = report["seeds"], statistics.stdev(diffs)
    assert seeds["sd"] == pytest.approx(sd) and seeds["sd_from"].startswith("4 seeds of ")
    assert seeds["seeds_equivalence"] == seeds_for_equivalence(sd, 0.02)
    assert seeds["seeds_difference"] == seeds_for_difference(sd, 0.02)
    for gpu, row in zip(report["gpus"], seeds["gpus"], strict=True):
        assert row["gpu_hours_equivalence"] == pytest.approx(
            2 * seeds["seeds_equivalence"] * gpu["gpu_hours"]
        )
    assert main([*tiny, "--seeds-for", "val_loss=0.02", "--sd", str(sd)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        f"LayerNorm vs RMSNorm at tiny to ±0.02 nats: {seeds['seeds_equivalence']} seeds per arm, "
        in lines[1]
    )
    assert "GPU-hours on H100" in lines[-1]
