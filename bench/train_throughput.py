"""Training tokens/s of the harness (train.py's real Lightning Trainer) next to two plain PyTorch loops.

All three train the same GPT from the same weights on the same windows, with the same accumulation, clipping
and AdamW step: ``harness`` (train.py itself), ``plain`` (the textbook loop over the harness's own dataset,
sampler, model, optimizer and schedule) and ``minimal`` (a loop from scratch; it checks the plain one). They
run interleaved, their order rotated per repeat; every repeat is printed, and the ratios of medians and of
bests. With ``--arms`` the harness trains each norm arm instead, with each arm's ratio to ``rms``.

    python bench/train_throughput.py                      # size=tiny on this machine
    python bench/train_throughput.py size=70m seq_len=256 micro_batch=4 global_batch=8 --steps 8
    python bench/train_throughput.py size=70m seq_len=256 micro_batch=4 global_batch=4 --steps 6 --arms
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import numpy as np
import torch
from benchlib import markdown_table, rotated, script_parser, synchronize
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from callbacks.run import train
from corpus.prepare import load_prepared
from corpus.stream import StepSampler, TokenWindows, tokens_per_step, window_offsets
from models.gpt import GPT
from models.hardware import default_precision
from models.lit import compute_dtype
from models.norms import NORM_ARMS
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.config.schema import TrainSchema
from normgeo.runs.build import make_datamodule, make_module
from normgeo.runs.start import start_session

VARIANTS = ("harness", "plain", "minimal")
REFERENCE_ARM = "rms"


class StepTimer(L.Callback):
    """Wall time of the optimizer steps after the first ``skip`` (compilation, allocator warm-up)."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.start: float | None = None
        self.end: float | None = None
        self.seen = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.seen:
            self.seen = trainer.global_step
            if trainer.global_step == self.skip:
                self.start = time.perf_counter()
            self.end = time.perf_counter()


def harness_tokens_per_s(composed: DictConfig, skip: int) -> float:
    timer = StepTimer(skip)
    with start_session(composed) as start:
        cfg = start.config
        train(start, extra_callbacks=[timer])
    steps = cfg.max_steps - skip
    return steps * tokens_per_step(cfg.global_batch, cfg.seq_len) / (timer.end - timer.start)


def autocast(cfg: TrainSchema, device: torch.device):
    """The harness's precision (bf16-mixed on GPUs that have it, fp32 on CPU) in a plain loop."""
    precision = str(cfg.trainer.get("precision") or default_precision())
    if precision.endswith("-mixed"):
        return torch.autocast(device.type, dtype=compute_dtype(precision))
    return nullcontext()


def timed_steps(cfg: TrainSchema, skip: int, device: torch.device, step: Callable[[int], None]) -> float:
    """Tokens/s of ``step(0) ... step(max_steps - 1)``, the first ``skip`` steps not timed."""
    start = 0.0
    for index in range(cfg.max_steps):
        if index == skip:
            synchronize(device)
            start = time.perf_counter()
        step(index)
    synchronize(device)
    seconds = time.perf_counter() - start
    return (cfg.max_steps - skip) * tokens_per_step(cfg.global_batch, cfg.seq_len) / seconds


def plain_tokens_per_s(cfg: TrainSchema, skip: int, device: torch.device) -> float:
    """The textbook loop on the harness's own parts: forward, backward (accumulated), clip, AdamW,
    schedule."""
    data = load_prepared(cfg.data.directory)
    windows = TokenWindows(str(data.path("train")), data.num_tokens("train"), cfg.seq_len, cfg.global_batch,
                           cfg.seed)
    module = make_module(cfg)
    model = module.model.to(device).train()
    # The harness's optimizer and schedule themselves, so that the loop is all that differs.
    optimizers = module.configure_optimizers()
    optimizer, schedule = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sampler = StepSampler(global_batch=cfg.global_batch, micro_batch=cfg.micro_batch, rank=0, world_size=1,
                          max_steps=cfg.max_steps, start_step=lambda: 0)
    indices = iter(sampler)

    def step(_: int) -> None:
        for _ in range(sampler.accumulation):
            inputs, targets = zip(*(windows[next(indices)] for _ in range(cfg.micro_batch)), strict=True)
            with autocast(cfg, device):
                loss = model(torch.stack(inputs).to(device), torch.stack(targets).to(device))
            (loss / sampler.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.trainer["gradient_clip_val"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_steps(cfg, skip, device, step)


def minimal_tokens_per_s(cfg: TrainSchema, skip: int, device: torch.device) -> float:
    """From scratch: one token tensor, the step's windows gathered by offsets, model(x, y), AdamW, clip,
    step."""
    data = load_prepared(cfg.data.directory)
    tokens = torch.from_numpy(np.asarray(data.tokens("train"), dtype=np.int64))
    model = GPT(cfg.gpt, seed=cfg.seed).to(device)
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
        fused=device.type == "cuda",  # as the harness: fused on GPUs, the default implementation on CPU
    )
    span = torch.arange(cfg.seq_len + 1)
    accumulation = cfg.global_batch // cfg.micro_batch

    def step(index: int) -> None:
        offsets = torch.from_numpy(
            window_offsets(cfg.seed, index, cfg.global_batch, len(tokens), cfg.seq_len + 1)
        )
        batch = tokens[offsets[:, None] + span].to(device)  # the same windows as the harness's stream
        for micro in batch.split(cfg.micro_batch):
            with autocast(cfg, device):
                loss = model(micro[:, :-1], micro[:, 1:])
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer["gradient_clip_val"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_steps(cfg, skip, device, step)


def listing(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):9.1f}   best {max(values):9.1f}   all {listing(values)}"


def ratio_line(name: str, top: list[float], bottom: list[float]) -> str:
    return (f"{name}: median / median {statistics.median(top) / statistics.median(bottom):.3f}   "
            f"best / best {max(top) / max(bottom):.3f}")


def markdown(results: dict[str, list[float]], reference: str) -> str:
    ref = results[reference]
    header = ["variant", "tokens/s median", "best", "all repeats", f"/ {reference} (medians)",
              f"/ {reference} (bests)"]
    return markdown_table(header, [
        [name, f"{statistics.median(values):.1f}", f"{max(values):.1f}", listing(values),
         f"{statistics.median(values) / statistics.median(ref):.3f}", f"{max(values) / max(ref):.3f}"]
        for name, values in results.items()
    ])


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps not timed")
    parser.add_argument("--repeats", type=int, default=3, help="interleave the variants this many times")
    parser.add_argument("--arms", nargs="?", const=",".join(NORM_ARMS), default=None,
                        help="harness tokens/s per norm arm instead (comma-separated; alone: all of "
                        "NORM_ARMS)")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = parser.parse_args()
    if not 0 <= args.skip < args.steps:
        parser.error("--skip must be at least 0 and less than --steps")
    arms = args.arms.split(",") if args.arms else None
    if arms and (unknown := set(arms) - set(NORM_ARMS)):
        parser.error(f"unknown arm(s) {', '.join(sorted(unknown))}: choose among {', '.join(NORM_ARMS)}")
    os.environ.setdefault("WANDB_MODE", "offline")
    # Removed when the timing ends: every harness run leaves a full-state last.ckpt (about 1 GB at 70m).
    scratch = tempfile.TemporaryDirectory(prefix="normgeo-bench-", ignore_cleanup_errors=True)
    workdir = Path(scratch.name)
    overrides = ["size=tiny", "seq_len=256", "global_batch=16", "micro_batch=8", "logger=none",
                 "probe.enabled=false", "checkpoint.steps=[]", "checkpoint.last_every=0", "val_every=100000",
                 "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                 f"max_steps={args.steps}", "optim.warmup_steps=0", f"data_root={workdir / 'data'}",
                 *args.overrides]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = arms or list(VARIANTS)
    results: dict[str, list[float]] = {name: [] for name in names}
    run = 0
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"), scratch:
        for repeat in range(args.repeats):
            for name in rotated(names, repeat):
                extra = [f"norm={name}"] if arms else []
                run_dir = f"run_dir={workdir / f'run{run}'}"
                composed = compose("train", overrides=[*overrides, *extra, run_dir])
                cfg = check_config("train", composed)
                run += 1
                if repeat == 0:
                    make_datamodule(cfg).prepare_data()  # tokenized before any timing (the loops need it)
                gc.collect()  # the previous variant's trainer, model and optimizer go before this one starts
                if arms or name == "harness":
                    results[name].append(harness_tokens_per_s(composed, args.skip))
                elif name == "plain":
                    results[name].append(plain_tokens_per_s(cfg, args.skip, device))
                else:
                    results[name].append(minimal_tokens_per_s(cfg, args.skip, device))
    threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name()
    timed = args.steps - args.skip
    print(f"device: {device} ({threads}), size={cfg.size.name}, seq_len={cfg.seq_len}, "
          f"global_batch={cfg.global_batch}, micro_batch={cfg.micro_batch}, steps timed={timed} "
          f"of {args.steps}, {args.repeats} interleaved repeats, order rotated")
    width = max(len(name) for name in names)
    for name, values in results.items():
        print(f"{name:{width}s} tokens/s: {summary(values)}")
    if arms:
        if REFERENCE_ARM in results:
            for name in names:
                print(ratio_line(f"{name} / {REFERENCE_ARM}", results[name], results[REFERENCE_ARM]))
        reference = REFERENCE_ARM if REFERENCE_ARM in results else names[0]
    else:
        print(ratio_line("harness / plain", results["harness"], results["plain"]))
        print(ratio_line("plain / minimal", results["plain"], results["minimal"]))
        reference = "plain"
    if args.markdown:
        print("\n" + markdown(results, reference))


if __name__ == "__main__":
    main()
