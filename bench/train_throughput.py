"""Training tokens/s of the harness (train.py's real Lightning Trainer) next to a plain PyTorch loop.

Both train the same GPT, from the same initial weights, on the same token windows, with the same
micro-batch, gradient accumulation, clipping and AdamW step. Only the harness's own overhead differs
(Lightning loop, sampler/DataLoader, logging, checkpoint callbacks). Prints one line per variant and
the ratio.

    python bench/train_throughput.py                      # size=tiny on this machine
    python bench/train_throughput.py size=70m seq_len=256 micro_batch=4 global_batch=8 --steps 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from corpus.stream import StepSampler, TokenWindows, tokens_per_step  # noqa: E402
from models.lit import warmup_cosine  # noqa: E402
from normgeo.runs.config import CONF_DIR  # noqa: E402
from train import train  # noqa: E402


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


def harness_tokens_per_s(cfg, skip: int) -> float:
    timer = StepTimer(skip)
    import train as train_module

    original = train_module.build_trainer

    def build_with_timer(cfg, run_dir, callbacks):
        return original(cfg, run_dir, [*callbacks, timer])

    train_module.build_trainer = build_with_timer
    try:
        train(cfg)
    finally:
        train_module.build_trainer = original
    steps = cfg.max_steps - skip
    return steps * tokens_per_step(cfg.global_batch, cfg.seq_len) / (timer.end - timer.start)


def plain_tokens_per_s(cfg, skip: int, device: torch.device) -> float:
    """The textbook loop: forward, backward (accumulated), clip, AdamW step, zero_grad."""
    from corpus.prepare import load_prepared

    data = load_prepared(cfg.data.directory)
    windows = TokenWindows(str(data.path("train")), data.num_tokens("train"), cfg.seq_len, cfg.global_batch, cfg.seed)
    model = instantiate(cfg.model).model.to(device)  # the harness's own GPT, from the same model node
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
    )
    sampler = StepSampler(global_batch=cfg.global_batch, micro_batch=cfg.micro_batch, rank=0, world_size=1,
                          max_steps=cfg.max_steps, start_step=lambda: 0)
    indices = iter(sampler)
    accumulation = sampler.accumulation
    start = None
    for step in range(cfg.max_steps):
        if step == skip:
            start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = cfg.optim.lr * warmup_cosine(
                step, warmup_steps=cfg.optim.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=0.1
            )
        for _ in range(accumulation):
            items = [windows[next(indices)] for _ in range(cfg.micro_batch)]
            inputs = torch.stack([x for x, _ in items]).to(device)
            targets = torch.stack([y for _, y in items]).to(device)
            (model(inputs, targets) / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (cfg.max_steps - skip) * cfg.global_batch * cfg.seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps not timed")
    parser.add_argument("--repeats", type=int, default=2, help="alternate the variants this many times")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    workdir = Path(tempfile.mkdtemp(prefix="normgeo-bench-"))
    overrides = [
        "size=tiny", "seq_len=256", "global_batch=16", "micro_batch=8", "logger=none", "probe.enabled=false",
        "checkpoint.steps=[]", "checkpoint.last_every=0", "val_every=100000", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", f"max_steps={args.steps}", f"data_root={workdir / 'data'}",
        *args.overrides,
    ]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(torch.get_num_threads())
    results: dict[str, list[float]] = {"harness": [], "plain": []}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for repeat in range(args.repeats):
            cfg = compose("train", overrides=[*overrides, f"run_dir={workdir / f'run{repeat}'}"])
            results["harness"].append(harness_tokens_per_s(cfg, args.skip))
            results["plain"].append(plain_tokens_per_s(cfg, args.skip, device))
    print(f"device: {device} ({torch.get_num_threads()} threads), size={cfg.size.name}, seq_len={cfg.seq_len}, "
          f"global_batch={cfg.global_batch}, micro_batch={cfg.micro_batch}, steps timed={args.steps - args.skip}")
    for name, values in results.items():
        print(f"{name:8s} tokens/s: best {max(values):10.1f}   all {', '.join(f'{v:.1f}' for v in values)}")
    print(f"harness / plain (best of each): {max(results['harness']) / max(results['plain']):.3f}")


if __name__ == "__main__":
    main()
