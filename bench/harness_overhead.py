"""What the harness adds to an optimizer step: its host syncs, and its host time against the bare step.

- **host syncs**: per optimizer step of a real ``train()`` run, counted by :func:`probe_cost.op_counts`; the
  logging steps (``LitGPT.reports_at``) read the loss back on purpose, the others should read nothing.
- **host time**: on the smallest model, a harness step against the bare step (``efficiency.Arm``) of the same
  config, alternated step by step; over ``--repeats`` runs their medians and ratio, wall and CPU time.

docs/benchmarks.md ("The harness's own cost per optimizer step") explains the method.

    python bench/harness_overhead.py                        # 24 profiled steps; 5 runs of 60 timed steps
    python bench/harness_overhead.py --steps 4 --warmup 1 --repeats 1 --sync-steps 4 --log-every 2   # seconds
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from benchlib import script_parser
from efficiency import STANDIN, Arm
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from probe_cost import op_counts
from torch.profiler import ProfilerActivity, profile, record_function

from callbacks.run import train
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.measure.geometry import gpu_code_path
from normgeo.runs.build import make_datamodule
from normgeo.runs.start import start_session

# One micro-batch per optimizer step (no accumulation), so that a harness step and a bare step do the same
# work; fused AdamW as a GPU steps it (on the CPU too: torch's fused CPU kernel).
SHAPE = [*STANDIN, "global_batch=2", "optim.fused=true", "optim.warmup_steps=0"]
# The harness as gpu_check's training rows run it: CSV metrics, no progress bar, probe or validation, the
# final checkpoint only.
HARNESS = ["trainer=cpu", "logger=csv", "trainer.enable_progress_bar=false",
           "trainer.enable_model_summary=false", "val_every=100000", "probe.enabled=false",
           "checkpoint.steps=[]", "checkpoint.last_every=0"]
SCOPE = "harness optimizer step "


class StepScopes(L.Callback):
    """A profiler scope per optimizer step, named :data:`SCOPE` + the step it ends at, from the start of its
    first micro-batch to the start of the next step's (its logging, callbacks and the next batch's loading
    included); the steps at which the module reports (reads its loss back on purpose) noted."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.logging: set[int] = set()
        self.scope: record_function | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.close()
            step = trainer.global_step + 1
            self.steps.append(step)
            if pl_module.reports_at(step):
                self.logging.add(step)
            self.scope = record_function(f"{SCOPE}{step}")
            self.scope.__enter__()

    def close(self) -> None:
        if self.scope is not None:
            self.scope.__exit__(None, None, None)
            self.scope = None

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self.close()


def compose_run(overrides: Sequence[str]) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def sync_counts(overrides: Sequence[str]) -> tuple[dict[int, dict[str, int]], set[int]]:
    """One ``train()`` run of ``overrides`` under torch.profiler: per optimizer step its host-sync counts
    (:func:`probe_cost.op_counts`), and the logging steps."""
    cfg = compose_run(overrides)
    scopes = StepScopes()
    # The probe's GPU code path on the CPU: the syncs counted are those a GPU would wait for.
    with gpu_code_path(), profile(activities=[ProfilerActivity.CPU]) as prof, start_session(cfg) as start:
        train(start, extra_callbacks=[scopes])
    events = prof.events()
    return {step: op_counts(events, scope=f"{SCOPE}{step}") for step in scopes.steps}, scopes.logging


class PairedBare(L.Callback):
    """Interleaves the bare step with the harness's, step by step, so that a shared machine's load hits both
    alike: before each optimizer step of the harness one bare step (``efficiency.Arm.step``) runs; from step
    ``warmup`` on both are timed, wall and the process's CPU time, a harness step from the end of the bare
    step before it to the start of the next one's (its data loading, logging and callbacks included)."""

    def __init__(self, arm: Arm, batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int,
                 steps: int) -> None:
        self.arm, self.batches, self.warmup, self.steps = arm, batches, warmup, steps
        self.times: dict[str, list[tuple[float, float]]] = {"harness": [], "bare": []}
        self.mark: tuple[float, float] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches:
            return
        now = time.perf_counter(), time.process_time()
        if self.mark is not None:
            self.times["harness"].append((now[0] - self.mark[0], now[1] - self.mark[1]))
        self.mark = None
        step = trainer.global_step
        self.arm.step(*self.batches[step % len(self.batches)])
        if self.warmup <= step < self.warmup + self.steps:
            done = time.perf_counter(), time.process_time()
            self.times["bare"].append((done[0] - now[0], done[1] - now[1]))
            self.mark = done


def paired_step_s(overrides: Sequence[str], arm: Arm, batches: list[tuple[torch.Tensor, torch.Tensor]],
                  warmup: int, steps: int) -> dict[str, tuple[float, float]]:
    """One ``train()`` run with :class:`PairedBare`: per optimizer step, the harness's and the bare step's
    mean seconds over the ``steps`` timed steps after ``warmup``, wall and CPU."""
    cfg = compose_run([*overrides, f"max_steps={warmup + steps + 1}"])  # the last step's end not timed
    paired = PairedBare(arm, batches, warmup, steps)
    with start_session(cfg) as start:
        train(start, extra_callbacks=[paired])
    return {name: (statistics.fmean(t[0] for t in values), statistics.fmean(t[1] for t in values))
            for name, values in paired.times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--sync-steps", type=int, default=24, help="optimizer steps of the profiled run")
    parser.add_argument("--log-every", type=int, default=10, help="log_every of the runs (train.py's)")
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps per run before the timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed training runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    args = parser.parse_args(argv)
    if min(args.sync_steps, args.log_every, args.steps, args.warmup, args.repeats, args.threads) < 1:
        parser.error("every count must be at least 1")
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="normgeo-harness-", ignore_cleanup_errors=True) as folder:
        work = Path(folder)
        shared = [*SHAPE, *HARNESS, f"log_every={args.log_every}", f"threads={args.threads}",
                  f"data_root={work / 'data'}"]
        make_datamodule(check_config("train", compose_run(shared))).prepare_data()  # tokenized before any run
        print(f"harness_overhead: {' '.join(SHAPE)}; {args.threads} thread(s); cpu; "
              f"load average before {os.getloadavg()[0]:.2f}")
        counts, logging = sync_counts([*shared, f"max_steps={args.sync_steps}", f"run_dir={work / 'syncs'}"])
        other = [step for step in counts if step not in logging]
        print(f"host syncs per optimizer step, one run of {args.sync_steps} steps, "
              f"log_every={args.log_every} (torch.profiler; bench/probe_cost.py's host-sync ops):")
        for name, steps in (("logging steps", sorted(logging)), ("other steps", other)):
            ops = sorted({op for step in steps for op in counts[step] if op.startswith("aten::")})
            print(f"  {name}: " + ", ".join(f"step {s}: {counts[s]['syncs']}" for s in steps)
                  + (f" ({', '.join(ops)})" if ops else ""))
        outside = sum(counts[step]["syncs"] for step in other)
        print(f"SYNCS OUTSIDE LOGGING STEPS: {outside} in {len(other)} steps "
              f"({outside / max(len(other), 1):.2f} per step); at logging steps "
              f"{statistics.median(counts[s]['syncs'] for s in logging):.0f} per step (median)")
        # The bare step of the harness's config, and two fixed batches of its shape.
        arm = Arm("tiny", "layer", "eager", torch.device("cpu"), standin=False, extra=shared)
        batches = arm.batches()
        times: dict[str, list[tuple[float, float]]] = {"harness": [], "bare": []}
        for repeat in range(args.repeats):
            gc.collect()
            run = paired_step_s([*shared, f"run_dir={work / f'run{repeat}'}"], arm, batches, args.warmup,
                                args.steps)
            for name, value in run.items():
                times[name].append(value)
    print(f"host time per optimizer step (ms), the mean of {args.steps} steps after {args.warmup} warm-up "
          f"per run, {args.repeats} runs, harness and bare steps alternated step by step; wall, and the "
          "process's CPU time:")
    medians = {}
    for index, clock in enumerate(("wall", "cpu")):
        for name, values in times.items():
            column = [value[index] for value in values]
            medians[name, clock] = statistics.median(column)
            all_ms = ", ".join(f"{v * 1e3:.3f}" for v in column)
            print(f"  {name:7s} {clock:4s} median {medians[name, clock] * 1e3:8.3f}  all {all_ms}")
    print("HARNESS / BARE (medians): "
          + ", ".join(f"{clock} {medians['harness', clock] / medians['bare', clock]:.3f} "
                      f"({(medians['harness', clock] - medians['bare', clock]) * 1e3:+.3f} ms a step)"
                      for clock in ("wall", "cpu"))
          + f"; load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
