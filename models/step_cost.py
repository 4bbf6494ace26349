"""What a training step costs on a GPU, planned on any machine without running it.

The model (:class:`models.lit.LitGPT`, as training builds it) and its AdamW are built under
``FakeTensorMode``; one training step runs on those fake tensors inside ``MemTracker`` (the peak by
category) and ``FlopCounterMode``, with CPU autocast (the same casts as CUDA's for this model). DDP adds its
gradient buckets; FSDP2 is derived from the trace analytically; a compiled run is planned as it runs
(:mod:`models.compiled_plan`). The launch gate (:func:`gate`) refuses only what cannot fit even its lower
bound (:func:`lower_bound`); between that and the planned peak it warns and the run starts. docs/plan.md
says what is modelled.

Floor: ``models/`` (imports models/ only). ``normgeo/plan.py`` prints the plan;
``train.py``'s pre-flight check (``normgeo/runs/preflight.py``) calls :func:`gate`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._composable import checkpoint
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from models.compiled_plan import compiled_peak, graph_flops, trace_compiled
from models.gpt import GPTConfig
from models.hardware import DTYPES
from models.lit import AdamWSettings, LitGPT

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int         # bytes the card reports (nvidia-smi memory.total)
    bf16_flops: float   # dense (no sparsity) bf16 tensor-core peak, FLOP/s


# Peak bf16 FLOP/s are the vendors' dense numbers (half the "with sparsity" ones).
GPUS: dict[str, GPU] = {
    # NVIDIA RTX A6000 datasheet: 309.7 TFLOPS tensor performance with sparsity -> 154.8 dense; 49140 MiB.
    # (Lightning's get_available_flops lists 38.7e12 for it, the non-tensor-core rate.)
    "a6000": GPU("RTX A6000 48 GB", 49140 * 2**20, 154.8e12),
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 tensor core 312 TFLOPS.
    "a100-40gb": GPU("A100 40 GB", 40960 * 2**20, 312e12),
    "a100-80gb": GPU("A100 80 GB", 81920 * 2**20, 312e12),
    # NVIDIA H100 datasheet, SXM5: BF16 tensor core 1,979 TFLOPS with sparsity -> 989.4 dense; 81559 MiB.
    "h100-80gb": GPU("H100 SXM 80 GB", 81559 * 2**20, 989.4e12),
    # NVIDIA H200 datasheet, SXM: BF16 tensor core 1,979 TFLOPS with sparsity -> 989.4 dense; 143771 MiB
    # (nvidia-smi on a lent H200).
    "h200-141gb": GPU("H200 SXM 141 GB", 143771 * 2**20, 989.4e12),
}

# Lightning precision setting -> (dtype the parameters are stored in, autocast dtype or None).
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "32-true": (torch.float32, None),
    "32": (torch.float32, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
}
STRATEGIES = ("single", "ddp", "fsdp2")

# The CPU flash-attention kernels (what SDPA runs on fake CPU tensors) have no FLOP formula in
# torch.utils.flop_counter; they do the same matmuls as the CUDA ones, so the CUDA formulas apply.
_aten = torch.ops.aten
SDPA_FLOPS: dict = {
    _aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
    ),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v)
    ),
}


class PeakMemTracker(MemTracker):
    """MemTracker without its per-module peaks, which cost a pass over every module for every operator (10x
    the step's time at 1B); the per-device peak and its breakdown are MemTracker's."""

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


@dataclass(frozen=True)
class TrainSetup:
    """What the plan of a training config needs (normgeo/plan.py fills it from the config)."""

    model: GPTConfig                # the run's model and its AdamW (TrainSchema.gpt, TrainSchema.optim)
    optim: AdamWSettings
    micro_batch: int
    global_batch: int
    precision: str = "bf16-mixed"
    strategy: str = "ddp"           # single | ddp | fsdp2
    world_size: int = 1
    activation_checkpointing: bool = False
    fsdp_param_dtype: str | None = "bfloat16"
    fsdp_reduce_dtype: str | None = "float32"
    gradient_clip: float | None = 1.0
    fused_adamw: bool = True        # LitGPT's choice on CUDA; false reproduces its CPU optimizer
    probe_batch: int = 8
    compiled: bool = False          # the run is compiled (compile resolved): the compiled step is planned

    def __post_init__(self) -> None:
        for key, value, allowed in (("precision", self.precision, PRECISIONS),
                                    ("strategy", self.strategy, STRATEGIES)):
            if value not in allowed:
                raise ValueError(f"{key} {value!r} cannot be planned: one of {', '.join(allowed)}")
        for name in (self.fsdp_param_dtype, self.fsdp_reduce_dtype):
            if name is not None and name not in DTYPES:
                raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)} or null")

    @property
    def seq_len(self) -> int:
        return self.model.block_size

    @property
    def accumulating(self) -> bool:
        """More than one micro-step per optimizer step: the gradients live through the later ones."""
        return self.global_batch > self.micro_batch * self.world_size

    @property
    def plans_compiled(self) -> bool:
        """Whether the compiled step is planned: compiled, and not FSDP2 (its blocks are compiled one by
        one between the sharding hooks; its compute is the eager trace)."""
        return self.compiled and self.strategy != "fsdp2"


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU at the peak, by category."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporaries

    def as_dict(self) -> dict[str, int]:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "total": self.total}


@dataclass(frozen=True)
class StepTrace:
    """One traced micro-step: the tracker's peak breakdown (bytes) and the forward + backward FLOPs."""

    peak: dict[str, int]
    flops: int

    def get(self, kind: str) -> int:
        return int(self.peak.get(kind, 0))


@dataclass(frozen=True)
class ModelCounts:
    parameters: int
    non_embedding: int        # without the token/position embeddings and an untied head
    matmul_parameters: int    # weights of the matmuls (every Linear's weight, head included)
    parameter_bytes: int
    optimizer_bytes: int      # AdamW state after its first step (exp_avg, exp_avg_sq, step)
    block_parameters: int     # one transformer block
    root_parameters: int      # outside the blocks: embeddings, final norm, head


@dataclass(frozen=True)
class Linear:
    """A peak linear in micro_batch, measured at two: peak(b) = fixed + per_sample * b."""

    fixed: float
    per_sample: float
    measured_at: tuple[int, int]

    def at(self, micro_batch: int) -> int:
        return int(round(self.fixed + self.per_sample * micro_batch))

    @classmethod
    def through(cls, b1: int, peak1: int, b2: int, peak2: int) -> Linear:
        """The line through the peaks traced at micro_batch ``b1`` and ``b2``."""
        slope = (peak1 - peak2) / (b1 - b2)
        return cls(peak1 - slope * b1, slope, (b1, b2))


@dataclass(frozen=True)
class StrategyPlan:
    checkpointing: bool
    memory: Memory                  # at the configured micro_batch
    peak: Linear                    # total per GPU against micro_batch
    flops_per_token: float          # counted, forward + backward (+ recompute with checkpointing)
    compiled: bool = False          # the compiled step (models.compiled_plan) rather than the eager trace


@dataclass
class Plan:
    setup: TrainSetup
    counts: ModelCounts
    analytic_flops_per_token: float     # 6 N_matmul + 12 L T d
    plans: dict[bool, StrategyPlan] = field(default_factory=dict)   # activation checkpointing off/on
    probe: Memory | None = None

    @property
    def configured(self) -> StrategyPlan:
        return self.plans[self.setup.activation_checkpointing]

    def tokens_per_step(self) -> int:
        return self.setup.global_batch * self.setup.seq_len

    def step_flops(self, checkpointing: bool | None = None) -> float:
        chosen = self.configured if checkpointing is None else self.plans[checkpointing]
        return chosen.flops_per_token * self.tokens_per_step()


def fits(peak: int, memory: int, headroom_gib: float, fragmentation: float) -> bool:
    """Whether a planned peak fits a card: CUDA context and NCCL (headroom_gib) + allocator fragmentation."""
    return peak * (1 + fragmentation) + headroom_gib * GIB <= memory


def valid_micro_batches(global_batch: int, world_size: int) -> list[int]:
    """The micro-batches the batch stream accepts: micro_batch x world size divides the global batch."""
    if global_batch % world_size:
        return []
    per_rank = global_batch // world_size
    return [b for b in range(1, per_rank + 1) if per_rank % b == 0]


def largest_micro_batch(peak: Linear, memory: int, global_batch: int, world_size: int,
                        headroom_gib: float, fragmentation: float) -> int | None:
    """The largest valid micro_batch whose extrapolated peak fits; None when not even 1 fits."""
    fitting = [b for b in valid_micro_batches(global_batch, world_size)
               if fits(peak.at(b), memory, headroom_gib, fragmentation)]
    return max(fitting) if fitting else None


# --------------------------------------------------------------------------------------------- tracing

@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters in ``dtype`` (Module.to cannot convert fake parameters a tracker holds weakly)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_module(setup: TrainSetup, dtype: torch.dtype | None = None) -> LitGPT:
    """The LightningModule as training builds it, parameters in ``dtype`` (default: the storage's)."""
    with default_dtype(dtype or PRECISIONS[setup.precision][0]):
        return LitGPT(setup.model, setup.optim, seed=0, max_steps=1, global_batch=setup.global_batch,
                      compile=setup.compiled)


def build_optimizer(module: LitGPT, fused: bool) -> torch.optim.Optimizer:
    """LitGPT's AdamW (its two weight-decay groups); fused as LitGPT makes it on CUDA."""
    optimizer = module.configure_optimizers()["optimizer"]
    if not fused:
        return optimizer
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    defaults = optimizer.defaults
    return torch.optim.AdamW(groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                             fused=True)


def warm_optimizer(module: LitGPT, optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients, so that the state exists as in every step after the first."""
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def random_batch(setup: TrainSetup, batch: int, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = setup.model.vocab_size
    shape = (batch, setup.seq_len)
    return torch.randint(0, vocab, shape, device=device), torch.randint(0, vocab, shape, device=device)


def autocast_of(setup: TrainSetup, device_type: str = "cpu"):
    """The precision's autocast on ``device_type``; on the CPU the same casts as CUDA's for the fake trace."""
    _, low = PRECISIONS[setup.precision]
    return torch.autocast(device_type, dtype=low) if low is not None else nullcontext()


def training_step(module: LitGPT, optimizer: torch.optim.Optimizer | None, setup: TrainSetup,
                  batch: tuple[torch.Tensor, torch.Tensor], flops: FlopCounterMode | None = None) -> None:
    """One micro-step as training takes it, for the fake trace and the measured step alike: forward under
    autocast, backward (what ``flops`` sees); with an optimizer also clipping and the AdamW step."""
    inputs, targets = batch
    with flops if flops is not None else nullcontext():
        with autocast_of(setup, inputs.device.type):
            loss = module.model(inputs, targets)
        loss.backward()
    if optimizer is not None:
        if setup.gradient_clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), setup.gradient_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def traced_step(module: LitGPT, optimizer: torch.optim.Optimizer | None, setup: TrainSetup, batch: int,
                checkpointing: bool) -> StepTrace:
    """One :func:`training_step` on a random batch inside a tracker and a FLOP counter (the optimizer's
    state tracked where there is one); ``checkpointing``: each block checkpointed as FSDP2Strategy does."""
    if checkpointing:
        for block in module.model.blocks:
            checkpoint(block)  # composable, names unchanged
    tracker = PeakMemTracker()
    if optimizer is not None:
        tracker.track_external(module.model, optimizer)
    counter = FlopCounterMode(display=False, custom_mapping=SDPA_FLOPS)
    inputs = random_batch(setup, batch)
    with tracker:
        training_step(module, optimizer, setup, inputs, counter)
    return StepTrace(snapshot(tracker), counter.get_total_flops())


def snapshot(tracker: MemTracker) -> dict[str, int]:
    """The tracker's peak on the CPU, keyed by category name (Parameter, Gradient, Optstate, ...)."""
    peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    return {getattr(k, "value", k): int(v) for k, v in peak.items()}


def trace_step(setup: TrainSetup, batch: int, *, checkpointing: bool, fake: bool = True) -> StepTrace:
    """Peak memory and FLOPs of one steady-state training step of one device (real tensors: fake=False)."""
    with FakeTensorMode() if fake else nullcontext():
        module = build_module(setup)
        optimizer = build_optimizer(module, setup.fused_adamw)
        warm_optimizer(module, optimizer)
        if setup.accumulating:  # a later micro-step: the earlier ones' gradients are there (summed into)
            for p in module.parameters():
                p.grad = torch.zeros_like(p)
        return traced_step(module, optimizer, setup, batch, checkpointing)


def trace_compiled_step(setup: TrainSetup, batch: int) -> StepTrace:
    """Peak memory and FLOPs of one steady-state compiled micro-step of one device in MemTracker's
    categories: the static state counted here, the graphs' buffers at their peak
    (:mod:`models.compiled_plan`)."""
    with FakeTensorMode():
        module = build_module(setup)
        graphs = trace_compiled(module, random_batch(setup, batch), lambda: autocast_of(setup))
    counts = model_counts(setup)
    peak = compiled_peak(graphs)
    accumulated = counts.parameter_bytes if setup.accumulating else 0  # gradients in the parameters' dtype
    return StepTrace({"Parameter": counts.parameter_bytes, "Optstate": counts.optimizer_bytes,
                      "Gradient": accumulated + peak.gradients, "Activation": peak.activations,
                      "Temp": peak.temporaries}, graph_flops(graphs, SDPA_FLOPS))


def trace_sharded_compute(setup: TrainSetup, batch: int, *, checkpointing: bool) -> StepTrace:
    """FSDP2's compute of one micro-step: parameters in param_dtype, each gradient freed once computed
    (FSDP2 reduce-scatters it into the shard). Parameters and shards are added analytically."""
    with FakeTensorMode():
        module = build_module(setup, DTYPES[setup.fsdp_param_dtype] if setup.fsdp_param_dtype else None)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda param: setattr(param, "grad", None))
        return traced_step(module, None, setup, batch, checkpointing)


def trace_probe(setup: TrainSetup) -> StepTrace:
    """The probe's forward pass (no gradients) at its batch size, in the training precision."""
    with FakeTensorMode():
        module = build_module(setup)
        module.model.eval()
        tracker = PeakMemTracker()
        tracker.track_external(module.model)
        inputs, _ = random_batch(setup, setup.probe_batch)
        with tracker, torch.no_grad(), autocast_of(setup):
            module.model(inputs)
        return StepTrace(snapshot(tracker), 0)


def model_counts(setup: TrainSetup) -> ModelCounts:
    with FakeTensorMode():
        module = build_module(setup)
        optimizer = build_optimizer(module, setup.fused_adamw)
        warm_optimizer(module, optimizer)
        model = module.model
        params = list(model.parameters())  # a tied matrix once
        embedding = model.wte.weight.numel() + model.wpe.weight.numel()
        if model.lm_head.weight is not model.wte.weight:
            embedding += model.lm_head.weight.numel()
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        block = sum(p.numel() for p in model.blocks[0].parameters()) if len(model.blocks) else 0
        total = sum(p.numel() for p in params)
        return ModelCounts(
            parameters=total,
            non_embedding=total - embedding,
            matmul_parameters=matmul,
            parameter_bytes=sum(p.numel() * p.element_size() for p in params),
            optimizer_bytes=sum(t.numel() * t.element_size() for t in state),
            block_parameters=block,
            root_parameters=total - block * len(model.blocks),
        )


# ------------------------------------------------------------------------------------------ strategies

def per_gpu(setup: TrainSetup, counts: ModelCounts, trace: StepTrace, compute: StepTrace | None) -> Memory:
    """The peak per GPU under the setup's strategy, from the single-device trace (and FSDP2's compute)."""
    rest = trace.get("Buffer") + trace.get("Other") + trace.get("Temp")
    if setup.strategy == "single":
        return Memory(trace.get("Parameter"), trace.get("Gradient"), trace.get("Optstate"),
                      trace.get("Activation"), rest)
    if setup.strategy == "ddp":
        # gradient_as_bucket_view: the gradients live in DDP's buckets, allocated once for good (a compiled
        # backward's gradients are copied into them: those alive at its peak come on top).
        fresh = trace.get("Gradient") - (counts.parameter_bytes if setup.accumulating else 0)
        new = max(fresh, 0) if setup.plans_compiled else 0
        return Memory(trace.get("Parameter"), counts.parameter_bytes + new, trace.get("Optstate"),
                      trace.get("Activation"), rest)
    assert compute is not None
    low = fsdp_param_bytes(setup)
    reduce = DTYPES[setup.fsdp_reduce_dtype].itemsize if setup.fsdp_reduce_dtype else low
    shard = math.ceil(counts.parameter_bytes / setup.world_size)
    # A block's unsharded gradient is cast to reduce_dtype for the reduce-scatter (when that differs).
    reduce_copy = counts.block_parameters * reduce if reduce != low else 0
    return Memory(
        parameters=shard + fsdp_gathered_bytes(setup, counts),
        gradients=shard + compute.get("Gradient") + reduce_copy,
        optimizer=math.ceil(counts.optimizer_bytes / setup.world_size),
        activations=compute.get("Activation"),
        temporaries=compute.get("Temp") + compute.get("Buffer") + compute.get("Other"),
    )


def fsdp_param_bytes(setup: TrainSetup) -> int:
    """Bytes of one gathered parameter element under FSDP2: its param_dtype, else the storage dtype."""
    dtype = DTYPES[setup.fsdp_param_dtype] if setup.fsdp_param_dtype else PRECISIONS[setup.precision][0]
    return dtype.itemsize


def fsdp_gathered_bytes(setup: TrainSetup, counts: ModelCounts) -> int:
    """The unsharded parameters FSDP2 holds at once: the root (embeddings, head) stays gathered from its
    forward to the end of the backward (never resharded after forward), a block while the next is
    prefetched."""
    return (counts.root_parameters + 2 * counts.block_parameters) * fsdp_param_bytes(setup)


def second_batch(micro_batch: int) -> int:
    """The other batch size the slope is measured at: half the configured one, or 2 for 1."""
    return micro_batch // 2 if micro_batch >= 2 else 2


def trace_memory(setup: TrainSetup, counts: ModelCounts, batch: int,
                 checkpointing: bool) -> tuple[Memory, float]:
    """The per-GPU memory of one step at micro_batch ``batch`` and its counted FLOPs per token: FSDP2's
    compute (its sharded state is analytic), the compiled step, or the eager step."""
    if setup.strategy == "fsdp2":
        trace = trace_sharded_compute(setup, batch, checkpointing=checkpointing)
        memory = per_gpu(setup, counts, trace, trace)
    elif plans_compiled(setup, checkpointing):
        trace = trace_compiled_step(setup, batch)
        memory = per_gpu(setup, counts, trace, None)
    else:
        trace = trace_step(setup, batch, checkpointing=checkpointing)
        memory = per_gpu(setup, counts, trace, None)
    return memory, trace.flops / (batch * setup.seq_len)


def plans_compiled(setup: TrainSetup, checkpointing: bool) -> bool:
    """Whether the step is planned compiled: activation checkpointing's column stays the eager trace."""
    return setup.plans_compiled and not checkpointing


def plan_strategy(setup: TrainSetup, counts: ModelCounts, checkpointing: bool,
                  batches: tuple[int, ...] | None = None) -> StrategyPlan:
    """Trace at the configured micro_batch and at a second one; peaks are linear in between and beyond."""
    b1, b2 = (batches or (setup.micro_batch, second_batch(setup.micro_batch)))[:2]
    m1, flops = trace_memory(setup, counts, b1, checkpointing)
    m2, _ = trace_memory(setup, counts, b2, checkpointing)
    return StrategyPlan(checkpointing, m1, Linear.through(b1, m1.total, b2, m2.total), flops,
                        plans_compiled(setup, checkpointing))


@dataclass(frozen=True)
class MeasuredStep:
    """A training step's peak as CUDA's allocator held it, measured on the device (:func:`measure_step`)."""

    peak: int                       # torch.cuda.max_memory_allocated over the steps, bytes
    micro_batch: int
    steps: int
    compiled: bool
    device: str


def measure_step(setup: TrainSetup, device: torch.device, *, steps: int = 3) -> MeasuredStep:
    """The peak over ``steps`` real optimizer steps of one device at the configured micro_batch (accumulating,
    compiled as ``compile=true`` trains), as over a training run; DDP's buckets and FSDP2's shards stay the
    trace's (:func:`per_gpu`)."""
    if device.type != "cuda":
        raise ValueError(f"measuring a step needs a CUDA device (allocator statistics), not {device}")
    compiled = setup.compiled
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    module = build_module(setup).to(device)  # built as training builds it (its init draws on the CPU)
    if compiled:
        module.model.compile()
    optimizer = build_optimizer(module, setup.fused_adamw)
    batch = random_batch(setup, setup.micro_batch, device)
    micro_steps = max(setup.global_batch // setup.micro_batch, 1)
    for _ in range(steps):
        for _ in range(micro_steps - 1):
            training_step(module, None, setup, batch)
        training_step(module, optimizer, setup, batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del module, optimizer
    torch.cuda.empty_cache()
    return MeasuredStep(peak, setup.micro_batch, steps, compiled, torch.cuda.get_device_name(device))


def analytic_flops_per_token(setup: TrainSetup, counts: ModelCounts) -> float:
    """6 N + 12 L T d (PaLM, appendix B) with N the matmul weights: an embedding lookup does no FLOPs."""
    m = setup.model
    return 6 * counts.matmul_parameters + 12 * m.n_layer * m.n_embd * setup.seq_len


def make_plan(setup: TrainSetup, *, both_checkpointing: bool = True, probe: bool = True) -> Plan:
    """The plan of ``setup``: counts, FLOPs, the peak per GPU with and without activation checkpointing."""
    counts = model_counts(setup)
    plan = Plan(setup, counts, analytic_flops_per_token(setup, counts))
    choices = (False, True) if both_checkpointing else (setup.activation_checkpointing,)
    for checkpointing in choices:
        plan.plans[checkpointing] = plan_strategy(setup, counts, checkpointing)
    if probe:
        plan.probe = probe_memory(setup, counts, trace_probe(setup))
    return plan


def probe_memory(setup: TrainSetup, counts: ModelCounts, trace: StepTrace) -> Memory:
    """At a probe the step is over: parameters, optimizer state (and DDP's buckets) stay; the probe's
    forward adds its activations. Under FSDP2 the shards stay and the forward gathers as in training."""
    if setup.strategy == "fsdp2":
        params = math.ceil(counts.parameter_bytes / setup.world_size) + fsdp_gathered_bytes(setup, counts)
        grads, optim = 0, math.ceil(counts.optimizer_bytes / setup.world_size)
    else:
        params, optim = counts.parameter_bytes, counts.optimizer_bytes
        grads = counts.parameter_bytes if setup.strategy == "ddp" else 0
    return Memory(params, grads, optim, trace.get("Activation"), trace.get("Temp") + trace.get("Other"))


# ------------------------------------------------------------------------------------------- pre-flight

@dataclass(frozen=True)
class GatePlan:
    """What the launch gate needs of a plan: JSON-able, kept in a run folder (normgeo.runs.preflight) so that
    every rank and every requeued session decides on the same numbers without tracing again."""

    peak: int                   # planned peak per GPU at micro_batch
    lower_bound: int            # what certainly lives at once (:func:`lower_bound`)
    fixed: float | None         # the peak against micro_batch: fixed + per_sample * b; None: one micro_batch
    per_sample: float | None    # traced, as the peak fit the card (:func:`traced_gate_plan`)
    compiled: bool              # the compiled step was planned (else the eager trace)
    micro_batch: int
    global_batch: int
    world_size: int
    memory: dict[str, int]      # the peak's categories (Memory.as_dict)
    accumulated_gradients: int  # gradients alive through the micro-steps after the first (0: none)

    @property
    def line(self) -> Linear:
        if self.fixed is None or self.per_sample is None:
            raise ValueError("this gate plan traced one micro_batch (its peak fit the card): it has no line")
        return Linear(self.fixed, self.per_sample, (self.micro_batch, self.micro_batch))

    def peak_fits(self, total_memory: int, headroom_gib: float) -> bool:
        """Whether the planned peak + the CUDA context fits the card: the gate starts the run without a
        word (fragmentation is not counted, as in :func:`gate`)."""
        return self.peak + headroom_gib * GIB <= total_memory

    @property
    def kind(self) -> str:
        return "compiled" if self.compiled else "eager"


def lower_bound(setup: TrainSetup, counts: ModelCounts) -> int:
    """Bytes that certainly live at once on a GPU during a step, whatever a compiler keeps: the exact static
    state (parameters, AdamW state, persistent gradients; under FSDP2 their shards) plus one micro-batch's
    logits in the autocast dtype (the head's matmul writes them whole while that state lives)."""
    low = PRECISIONS[setup.precision][1] or PRECISIONS[setup.precision][0]
    logits = setup.micro_batch * setup.seq_len * setup.model.padded_vocab_size * low.itemsize
    persistent_gradients = setup.strategy == "ddp" or setup.accumulating or setup.strategy == "fsdp2"
    state = counts.parameter_bytes + counts.optimizer_bytes
    state += counts.parameter_bytes if persistent_gradients else 0
    if setup.strategy == "fsdp2":
        state = math.ceil(state / setup.world_size)
    return state + logits


def gate_plan(plan: Plan) -> GatePlan:
    chosen = plan.configured
    planned = line_free_gate_plan(plan.setup, plan.counts, chosen.memory, chosen.compiled)
    return replace(planned, fixed=chosen.peak.fixed, per_sample=chosen.peak.per_sample)


def line_free_gate_plan(setup: TrainSetup, counts: ModelCounts, memory: Memory, compiled: bool) -> GatePlan:
    """The gate's plan of one traced micro_batch (no line through a second one)."""
    return GatePlan(memory.total, lower_bound(setup, counts), None, None, compiled, setup.micro_batch,
                    setup.global_batch, setup.world_size, memory.as_dict(),
                    accumulated_gradients(setup, counts))


def traced_gate_plan(setup: TrainSetup, total_memory: int, headroom_gib: float) -> GatePlan:
    """The gate's plan with the fewest traces: the configured step's, and a second micro_batch's (the slope
    that names the largest micro_batch that fits) only when the first peak + the CUDA context does not fit."""
    counts, checkpointing = model_counts(setup), setup.activation_checkpointing
    memory, _ = trace_memory(setup, counts, setup.micro_batch, checkpointing)
    planned = line_free_gate_plan(setup, counts, memory, plans_compiled(setup, checkpointing))
    if planned.peak_fits(total_memory, headroom_gib):
        return planned
    second = second_batch(setup.micro_batch)
    other, _ = trace_memory(setup, counts, second, checkpointing)
    line = Linear.through(setup.micro_batch, memory.total, second, other.total)
    return replace(planned, fixed=line.fixed, per_sample=line.per_sample)


def accumulated_gradients(setup: TrainSetup, counts: ModelCounts) -> int:
    """Gradients alive through the micro-steps after the first, one device accumulating (0: none)."""
    return counts.parameter_bytes if setup.accumulating and setup.strategy == "single" else 0


@dataclass(frozen=True)
class GateDecision:
    refusal: str | None     # one line: the launch is refused
    warning: str | None     # one line: the launch goes on, the plan says it may not fit


def gate(planned: GatePlan, total_memory: int, device_name: str, *, headroom_gib: float,
         fragmentation: float) -> GateDecision:
    """The launch gate: refused when even the lower bound (:func:`lower_bound`) + the CUDA context
    (headroom_gib) exceeds the card, warned when the planned peak + the context does (the plan may overstate
    what the allocator holds). Fragmentation is counted only in the largest micro_batch named."""
    if planned.peak_fits(total_memory, headroom_gib):
        return GateDecision(None, None)
    best = largest_micro_batch(planned.line, total_memory, planned.global_batch, planned.world_size,
                               headroom_gib, fragmentation)
    advice = (f"micro_batch={best} fits the plan (a start and a resume accept it)" if best is not None
              else "no micro_batch fits the plan: more GPUs, trainer=fsdp or activation checkpointing")
    m = planned.memory
    parts = (f"parameters {m['parameters'] / GIB:.1f}, gradients {m['gradients'] / GIB:.1f}"
             + (f" (of which {planned.accumulated_gradients / GIB:.1f} accumulated over micro-steps)"
                if planned.accumulated_gradients else "")
             + f", AdamW state {m['optimizer'] / GIB:.1f}, activations {m['activations'] / GIB:.1f}, "
             f"temporaries {m['temporaries'] / GIB:.1f} GiB")
    card = f"the {total_memory / GIB:.1f} GiB of {device_name}"
    planned_text = (f"the {planned.kind} plan's peak {planned.peak / GIB:.1f} GiB per GPU at micro_batch="
                    f"{planned.micro_batch} ({parts})")
    if planned.lower_bound + headroom_gib * GIB > total_memory:
        return GateDecision(
            f"micro_batch={planned.micro_batch} cannot fit: even the least it needs, "
            f"{planned.lower_bound / GIB:.1f} GiB (the static state and the logits) + {headroom_gib:g} GiB "
            f"CUDA context, exceeds {card}; {planned_text}; {advice} "
            "(python -m normgeo.plan <same overrides>; plan.check=false skips this check)", None)
    return GateDecision(None, (
        f"{planned_text} + {headroom_gib:g} GiB CUDA context exceeds {card}, its lower bound "
        f"{planned.lower_bound / GIB:.1f} GiB does not: starting; should it run out of memory, {advice}"))


@contextmanager
def quiet_plan() -> Iterator[None]:
    """Fake-tensor tracing warns about nothing the user can act on (e.g. autocast on CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield

