"""The LightningModule that trains :class:`models.gpt.GPT`: loss, AdamW, warm-up + cosine, metrics."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Protocol

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from corpus.stream import tokens_per_step
from models.divergence import Divergence
from models.gpt import GPT, GPTConfig
from models.strategies import FSDP2Strategy, compile_blocks

log = logging.getLogger(__name__)


class AdamWSettings(Protocol):
    """What the module reads of the run's ``optim`` node (normgeo.config.schema.OptimSchema, a floor above
    models/, declares the keys, their ranges and defaults)."""

    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    betas: Sequence[float]
    fused: bool | None


# Lightning's table finds no H200 named as CUDA reports it ("NVIDIA H200": its rows need "sxm1" or "nvl1"),
# and its H200 rows hold the with-sparsity figures. The H200 SXM has the H100 SXM's tensor cores and clocks:
# NVIDIA's H200 datasheet gives BF16 1,979 TFLOPS with sparsity, 989.4 dense.
H200_DENSE_FLOPS: dict[torch.dtype, float] = {torch.bfloat16: 989.4e12, torch.float16: 989.4e12,
                                               torch.float32: 66.9e12}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device`` in ``dtype`` (the MFU denominator): Lightning's get_available_flops,
    the H200 added; None on the CPU and on GPUs neither knows (no MFU then)."""
    if device.type != "cuda":
        return None
    if "h200" in torch.cuda.get_device_name(device).lower():
        return H200_DENSE_FLOPS.get(dtype)
    return get_available_flops(device, dtype)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls run in under a Lightning precision setting (bf16-mixed, 16-mixed, 32-true)."""
    return torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LitGPT(L.LightningModule):
    def __init__(self, model: GPTConfig, optim: AdamWSettings, *, seed: int, max_steps: int,
                 global_batch: int, compile: bool = False) -> None:
        super().__init__()
        # Plain values: Lightning loads a checkpoint's hyper_parameters with weights_only=True. logger=False:
        # train.py logs the whole run config once; the module's subset would repeat it.
        self.save_hyperparameters({"model": asdict(model), "optim": asdict(optim), "seed": seed,
                                   "max_steps": max_steps, "global_batch": global_batch, "compile": compile},
                                  logger=False)
        self.optim = optim
        self.model = GPT(model, seed=seed)
        # Decided here, on the bare model, by name: FSDP2 and compile keep names, while a sharding scheme
        # that flattens parameters (FSDP1) would show every one as 1-D by the time the optimizer is made.
        self._matrix_names = frozenset(name for name, p in self.model.named_parameters() if p.dim() >= 2)
        self._loss_sum: torch.Tensor | None = None
        self._micro_steps = 0
        self._step_loss: torch.Tensor | None = None  # the latest optimizer step's global loss, on the device
        self._step_lr = 0.0  # and its learning rate
        self._reported_step: int | None = None  # the latest step reported (None: none yet this session)
        # The latest report's loss and rate as host values, for the console (callbacks.progress): logged with
        # prog_bar=True instead, Lightning would read them back from the device after every batch.
        self.console_metrics: dict[str, float] = {}
        self.divergence = Divergence(optim.lr)  # the first non-finite loss, on the device
        self.validated_at: int | None = None  # the step of the latest validation (its val/loss)
        # The resolved run config (normgeo.runs.run_config), set by train.py and saved in every checkpoint;
        # not an hparam, so that save_hyperparameters() and the hparams stay the model's arguments.
        self.run_config: dict | None = None
        self._model_configured = False
        self.throughput: Throughput | None = None  # set on train start (start_throughput)
        self.device_step_flops = 0.0

    @property
    def seq_len(self) -> int:
        return self.model.config.block_size

    @property
    def tokens_per_step(self) -> int:
        return tokens_per_step(self.hparams.global_batch, self.seq_len)

    def on_train_start(self) -> None:
        # MFU against the dense peak FLOP/s of this GPU and dtype (none on the CPU and on unknown GPUs).
        self.start_throughput(peak_flops(self.device, compute_dtype(str(self.trainer.precision))),
                              self.trainer.world_size)

    def start_throughput(self, available_flops: float | None, world_size: int) -> None:
        """A session's rate meter (:meth:`step_rates`): a window of two calls, the rates over the steps
        between; the model FLOPs of one step on one device, counted once."""
        self.throughput = Throughput(available_flops=available_flops, world_size=world_size, window_size=2)
        self._rated_step: int | None = None
        self.device_step_flops = self.model.flops_per_token(self.seq_len) * self.tokens_per_step / world_size

    def step_rates(self, step: int, now: float) -> dict[str, float]:
        """``perf/tokens_per_s`` (all devices) and ``perf/mfu`` since this session's previous call (none at
        its first), by Lightning's Throughput per optimizer step; called at reporting steps, after the host
        waited for the device, so that the time spans exactly the steps between."""
        world_size = self.throughput.world_size
        sequences = step * self.hparams.global_batch // world_size  # per device, as Throughput counts
        steps = step - (self._rated_step if self._rated_step is not None else step - 1)
        self._rated_step = step
        self.throughput.update(time=now, batches=step, samples=sequences, lengths=sequences * self.seq_len,
                               flops=self.device_step_flops * steps)
        rates = self.throughput.compute()
        named = (("perf/tokens_per_s", "device/items_per_sec", world_size), ("perf/mfu", "device/mfu", 1))
        return {name: rates[key] * scale for name, key, scale in named if key in rates}

    def configure_model(self) -> None:
        """Shard (FSDP2) and/or compile once; Lightning calls this hook again for every stage."""
        if self._model_configured:
            return
        self._model_configured = True
        sharded = isinstance(self.trainer.strategy, FSDP2Strategy)
        if sharded:
            self.trainer.strategy.shard(self.model)
        if self.hparams.compile:
            # Both keep parameter names, so checkpoints load with or without compile. Under FSDP2 each
            # block is compiled on its own so that the sharding hooks stay outside the graphs.
            compile_blocks(self.model) if sharded else self.model.compile()
            log.info("torch.compile: model compiled; the first steps are slow while kernels are generated")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.model(inputs, targets)
        detached = loss.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._micro_steps += 1
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Once per optimizer step: the step's global loss and the first non-finite one, noted on the device
        (a host read would wait every step); at a reporting step (:meth:`reports_at`), :meth:`report`."""
        step_loss = self._loss_sum / self._micro_steps
        loss = self.trainer.strategy.reduce(step_loss, reduce_op="mean")
        self._loss_sum, self._micro_steps = None, 0
        step = self.trainer.global_step + 1
        self.divergence.note(loss, step)
        self._step_loss, self._step_lr = loss, optimizer.param_groups[0]["lr"]
        if self.reports_at(step):
            self.report(step)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # A callback may have stopped training at this step (a signal, stop_at_step): Lightning logs it then,
        # so the loss it logs must be this step's (callbacks' hooks run before the module's).
        step = self.trainer.global_step
        if self._micro_steps == 0 and self.trainer.should_stop and self._reported_step != step:
            self.report(step)

    def reports_at(self, step: int) -> bool:
        """Whether the loss, rates and divergence of optimizer step ``step`` are read back from the device:
        every ``log_every_n_steps``, this session's first step and the run's last (the console's figures)."""
        every = self.trainer.log_every_n_steps
        first_or_last = self._reported_step is None or step == self.trainer.max_steps
        return (every > 0 and step % every == 0) or first_or_last

    def report(self, step: int) -> None:
        """Wait for the device once (:meth:`Divergence.check`), then log step ``step``'s loss, learning rate,
        tokens seen and the rates over the steps since the previous report, now timed exactly."""
        (loss,) = self.divergence.check(self._step_loss)
        self._reported_step = step
        rates = self.step_rates(step, time.perf_counter())
        # train/lr: the rate this step's update used
        metrics = {"train/loss": self._step_loss, "train/lr": self._step_lr,
                   "train/tokens_seen": float(step * self.tokens_per_step), **rates}
        self.console_metrics = {"loss": loss, **(
            {"tok/s": rates["perf/tokens_per_s"]} if "perf/tokens_per_s" in rates else {})}
        # "step" sets the x of this log call (Lightning's logger connector pops it): the k-th update's loss
        # at step k, the step at which the probe records the weights that update produced.
        metrics["step"] = float(step)
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, rank_zero_only=True)
        every = self.trainer.log_every_n_steps
        if step == self.trainer.max_steps and every > 0 and step % every and not self.trainer.should_stop:
            # Lightning writes to its loggers every log_every_n_steps (or at a stop) only: the last step's
            # loss, the one summary.json and compare report, would be missing from the log and from status.
            written = {key: float(value) for key, value in metrics.items() if key != "step"}
            for logger in self.trainer.loggers:
                logger.log_metrics(written, step=step)

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.divergence.check()  # no validation loss of weights that a non-finite loss updated

    def on_train_end(self) -> None:
        self.divergence.check()  # a run whose last steps diverged between two reports has not finished

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val/loss", self.model(inputs, targets), on_epoch=True, sync_dist=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        # Lightning would log the validation after update k at step k-1: at k, like the loss and probe.
        if not self.trainer.sanity_checking:
            self.log("step", float(self.trainer.global_step), on_epoch=True, on_step=False)
            self.validated_at = self.trainer.global_step  # the console says which validation a val/loss is

    def configure_optimizers(self):
        optim = self.optim
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # Weight decay on matrices only (embeddings included), never on gains and biases.
        groups = [
            {"params": [p for n, p in named if n in self._matrix_names], "weight_decay": optim.weight_decay},
            {"params": [p for n, p in named if n not in self._matrix_names], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas),
                                      fused=self._fused_adamw())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(
            step, warmup_steps=optim.warmup_steps, max_steps=self.hparams.max_steps,
            min_lr_ratio=optim.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _fused_adamw(self) -> bool:
        """AdamW's fused kernel: as asked (optim.fused), by default on CUDA only (CPU runs keep foreach's
        floating-point order). Not under an fp16 GradScaler with clipping: the fused step unscales the
        gradients itself, so they could not be clipped unscaled before it (Lightning refuses that pairing)."""
        fused = self.device.type == "cuda" if self.optim.fused is None else bool(self.optim.fused)
        try:
            trainer = self.trainer
        except RuntimeError:  # a module on its own: its optimizer built outside a Trainer
            trainer = None
        scaled = trainer is not None and getattr(trainer.precision_plugin, "scaler", None) is not None
        if fused and scaled and trainer.gradient_clip_val:
            if self.optim.fused:
                log.warning("optim.fused=true: not with 16-mixed and gradient clipping (the fused step "
                            "unscales the gradients itself); AdamW runs unfused")
            return False
        return fused

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer,
                                    gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        # Lightning's mixed precision refuses to clip before any fused optimizer's step, for fp16's sake (that
        # step unscales the gradients). bf16-mixed has no scaler, the gradients are already true: clip them.
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val or 0.0,
                                     gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        for state in checkpoint.get("optimizer_states", []):
            self._key_optimizer_state_by_parameter_index(state)
        # Lightning restores model, optimizer, scheduler and step; the RNGs (dropout) are ours to keep.
        # Only tensors and plain Python values: Lightning loads checkpoints with weights_only=True.
        _, keys, position, has_gauss, cached_gauss = np.random.get_state()
        checkpoint["rng"] = {
            "torch": torch.get_rng_state(),
            "numpy": [torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss),
                      float(cached_gauss)],
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }
        checkpoint["gpt_config"] = self.model.config.to_dict()
        if self.run_config is not None:
            checkpoint["run_config"] = self.run_config  # checked when the run is resumed

    def _key_optimizer_state_by_parameter_index(self, state: dict) -> None:
        """Key a saved optimizer state by each parameter's index in ``self.parameters()``, in place, as FSDP2
        full checkpoints are (a plain optimizer numbers its parameters group after group): one convention
        makes every checkpoint resumable under every strategy."""
        if not state or not self.trainer.optimizers:
            return  # FSDP2 ranks other than 0 hold an empty state
        index = {id(p): i for i, p in enumerate(self.parameters())}
        live = [p for group in self.trainer.optimizers[0].param_groups for p in group["params"]]
        saved = [key for group in state["param_groups"] for key in group["params"]]
        remap = {old: index[id(param)] for old, param in zip(saved, live, strict=True)}
        state["state"] = {remap[key]: value for key, value in state["state"].items()}
        for group in state["param_groups"]:
            group["params"] = [remap[key] for key in group["params"]]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        rng = checkpoint.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            keys, position, has_gauss, cached_gauss = rng["numpy"]
            state = ("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss)
            np.random.set_state(state)
            random.setstate(rng["python"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
