"""The typed schema of train.py's and analyze.py's configs: one declaration per key, read by two libraries.

Each key is a dataclass field with its range (``Count``: int >= 1), default and ``--help`` line (:func:`doc`).
Hydra composes with the dataclasses (a wrong type or unknown key fails there); pydantic validates the result
against the same ones (:func:`check_types`: ranges, finite floats, a ``+key`` the schema lacks), so nothing is
declared twice. Registries (norm, placement, tokenizer) judge their names before anything is written; the
Trainer's arguments are Lightning's to judge, on the machine that runs."""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from typing import Annotated, Any

import torch
from annotated_types import Interval, Len
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from pydantic import TypeAdapter, ValidationError

from corpus.refusal import Refusal
from corpus.sources import LocalFilesSource, SourceError
from corpus.stream import accumulation_steps
from corpus.tokenize import unknown_tokenizer
from models.gpt import PLACEMENTS, ArchitectureError, GPTConfig
from models.hardware import missing_cuda
from models.norms import NORM_ARMS, NORM_IMPLS, compile_refusal
from normgeo.config.fields import (
    SOURCE_BEFORE,
    Count,
    Fraction,
    Natural,
    NonNegative,
    Positive,
    Seed,
    doc,
    schema,
)
from normgeo.measure.intervention import INTERVENABLE_KINDS, SCOPE_KINDS
from normgeo.measure.probe_config import BootstrapConfig, ProbeConfig


def format_value(value: Any) -> str:
    """As the value would be written on the command line (null, true, [0.9, 0.95], rms)."""
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


# The Trainer's arguments that may change on resume (the global batch is fixed, so the devices only change the
# accumulation; how it reports).
TRAINER_MAY_CHANGE = ("devices", "num_nodes", "accelerator", "strategy", "enable_progress_bar",
                      "enable_model_summary", "log_every_n_steps")


@schema
class NormSchema:
    name: str = doc(MISSING, f"the norm of every block and the final norm: {' | '.join(NORM_ARMS)}")
    eps: Positive = doc(1e-5, "added to the variance (LayerNorm) or mean square (RMSNorm)")
    impl: str = doc("stock", f"how every norm runs: {' | '.join(NORM_IMPLS)} "
                             "(torch.compile of each norm's forward)", may_change=True)  # the same weights


@schema
class PlacementSchema:
    name: str = doc(MISSING, f"where the norms sit in a block: {' | '.join(PLACEMENTS)}", before="pre")
    run_suffix: str = doc("", "appended to the norm in run names (pre-norm runs keep their names)", before="")


@schema
class SizeSchema:
    name: str = doc(MISSING, "the size's name (run names, wandb group)")
    n_layer: Count = doc(MISSING, "transformer blocks")
    n_head: Count = doc(MISSING, "attention heads; must divide n_embd")
    n_embd: Count = doc(MISSING, "model width d")
    seq_len: Count = doc(MISSING, "default of the top-level seq_len")
    lr: Positive = doc(MISSING, "default peak learning rate (optim.lr)")
    warmup_steps: Natural = doc(MISSING, "default warm-up (optim.warmup_steps)")
    max_steps: Count = doc(MISSING, "default max_steps")
    micro_batch: Count = doc(MISSING, "default micro_batch", may_change=True)
    gpus: Natural | None = doc(None, "GPUs per SLURM job (hydra/launcher=slurm); 0: a CPU-only job",
                               may_change=True)
    minutes: Count = doc(60, "SLURM time limit per job, minutes", may_change=True)


@schema
class OptimSchema:
    lr: Positive = doc(MISSING, "peak learning rate")
    min_lr_ratio: Fraction = doc(0.1, "cosine decay ends at this fraction of the peak")
    warmup_steps: Natural = doc(MISSING, "linear warm-up steps (0: none); "
                                         "not fewer than max_steps: a warning")
    weight_decay: NonNegative = doc(0.1, "AdamW weight decay on matrices")
    betas: Annotated[list[Annotated[float, Interval(ge=0, lt=1)]], Len(2, 2)] = doc(
        [0.9, 0.95], "AdamW betas")
    fused: bool | None = doc(None, "AdamW's fused kernel: null = on CUDA only; true also on the CPU",
                             may_change=True)


CHECKPOINT_SCHEDULE = "callbacks.checkpointing.CheckpointSchedule"  # runs recorded before the key: theirs


@schema
class CheckpointSchema:
    _target_: str = doc(MISSING, "the schedule's class (callbacks.checkpointing.CheckpointSchedule; "
                                 "it ends with max_steps)", before=CHECKPOINT_SCHEDULE)
    steps: list[Count] | None = doc(None, "explicit checkpoint/probe steps, increasing, each <= max_steps")
    dense_every: Count = doc(1000, "a checkpoint every this many steps up to dense_until")
    dense_until: Count = doc(10000, "end of the dense part of the schedule")
    sparse_every: Count = doc(10000, "a checkpoint every this many steps after it")
    last_every: Natural = doc(500, "refresh last.ckpt (for resuming) this often; 0: only at scheduled steps",
                              may_change=True)
    keep_optimizer: bool = doc(False, "scheduled checkpoints keep the optimizer state too")
    every_minutes: Positive | None = doc(None, "also refresh last.ckpt when this many minutes passed since "
                                               "the last one (rank 0's clock); null: off", may_change=True)


@schema
class TrainProbeSchema(ProbeConfig):
    """train.py's probe: the shared keys and two that analyze.py (which always measures) would ignore."""

    enabled: bool = doc(True, "measure the angles at every scheduled step")
    batch_size: Count = doc(8, "probe sequences per forward pass", may_change=True)
    figures: bool = doc(True, "draw the run's figures from its records when it ends (seconds on a CPU); "
                              "false: python -m normgeo.report <run_dir> draws them later", may_change=True)


@schema
class DataSchema:
    _target_: str = doc(MISSING, "the data module's class (corpus.datamodule.TokenDataModule)")
    name: str = doc(MISSING, "the corpus's name (its prepared folder)")
    source: Any = doc(MISSING, "_target_ node of the training text (corpus.sources); data=local: path, "
                      "text_field, plain_text_extensions (other extensions read as plain text, e.g. [.md]), "
                      "encoding (utf-8; e.g. latin-1)", may_change=("config_node",), before=SOURCE_BEFORE)
    # conf/train/data/*.yaml derive them from data_root
    directory: str = doc(MISSING, "where the prepared token files live", may_change=True)
    tokenizer: str = doc("gpt2", "tiktoken encoding")
    val_fraction: Annotated[float, Interval(gt=0, lt=1)] = doc(
        0.005, "fraction of documents held out for validation")
    auto_prepare: bool = doc(True, "prepare on the fly when missing (else refuse and name the command)")
    prepare_command: str = doc("", "the command that prepares this corpus", may_change=True)
    seed: Seed = doc(MISSING, "the batch order (default: the top-level seed); data.seed=N varies the batches "
                     "alone, the initial weights keep seed")


@schema
class PlanSchema:
    check: bool = doc(True, "on a GPU, refuse a launch whose least memory cannot fit (exit 2) and warn "
                      "when the planned peak may not; may change on resume")
    device_memory_gib: Positive | None = doc(
        None, "the device memory the launch gate checks against, GiB (null: the GPU's own; set, the gate "
        "runs on any accelerator)")
    mfu: Annotated[float, Interval(gt=0, le=1)] = doc(
        0.4, "model FLOPs utilization for the planned time and GPU-hours")
    headroom_gib: NonNegative = doc(1.5, "GiB per GPU for the CUDA context and NCCL")
    fragmentation: NonNegative = doc(0.1, "allocator fragmentation margin on the planned peak")
    devices: Count | None = doc(None, "GPUs per node planned for when trainer.devices=auto (null: size.gpus)")
    gpus: list[str] = doc(["a6000", "a100-40gb", "a100-80gb", "h100-80gb"],
                          "GPU types to plan for (models/step_cost.py)")


@schema
class TrainSchema:
    seed: Seed = doc(0, "initial weights and dropout; also the batch order through data.seed (default: seed)")
    threads: Count | None = doc(None, "torch CPU threads (torch.set_num_threads); null: torch's default "
                                "(OMP_NUM_THREADS, else every core). The count sets the floating-point "
                                "sum order", before=None)
    # Which session, and where (may_change): the run's outputs stay where its first session put them.
    run_name: str = doc(MISSING, "the run directory's name", may_change=True)
    output_root: str = doc("outputs", "where run directories go", may_change=True)
    run_dir: str = doc(MISSING, "the run directory", may_change=True)
    data_root: str = doc(MISSING, "where prepared corpora go (env NORMGEO_DATA, default ./data)",
                         may_change=True)
    resume: str | None = doc(None, "null: refuse a directory with checkpoints; auto: continue; "
                                   "or a .ckpt path", may_change=True)
    stop_at_step: Count | None = doc(None, "end this session after this optimizer step (resumable; "
                                           "null: at max_steps)", may_change=True)
    max_steps: Count = doc(MISSING, "optimizer steps of the whole run")
    global_batch: Count = doc(64, "sequences per optimizer step over all devices")
    # The global batch is fixed: the devices and the micro batch only change the accumulation.
    micro_batch: Count = doc(MISSING, "sequences per device per forward pass; divides global_batch",
                             may_change=True)
    seq_len: Count = doc(MISSING, "tokens per sequence (the model's context)")
    num_workers: Natural = doc(0, "DataLoader workers", may_change=True)
    compile: bool | str = doc("auto", "torch.compile the model: true | false | auto (on when training on "
                              "CUDA, off on the CPU, where compiling costs more than it saves in short runs)",
                              may_change=True)  # the same math: another kernel, floating-point order
    tie_embeddings: bool = doc(False, "tie the input and output embeddings")
    # The model's other choices, fixed before they were keys (before=: what every earlier run had).
    dropout: Annotated[float, Interval(ge=0, lt=1)] = doc(
        0.0, "dropout on the embeddings, attention and residual writes (GPT-2: 0.1); the probe measures "
        "in eval mode", before=0.0)
    bias: bool = doc(True, "biases in the attention and MLP linear layers", before=True)
    init_std: Positive = doc(0.02, "std of the initial weights (the residual projections': divided by "
                             "sqrt(2 n_layer))", before=0.02)
    vocab_multiple: Count = doc(64, "the embedding table padded to a multiple of this for fast matmuls "
                                "(padded rows are never targets)", before=64)
    val_every: Count = doc(1000, "optimizer steps between validations")
    val_sequences: Count = doc(64, "validation sequences; at most the validation split's distinct windows")
    val_seed: Seed | None = doc(None, "the validation windows' draw; null: seed (each seed its own windows); "
                                "a number: the same windows for every arm and seed", before=None)
    log_every: Count = doc(10, "optimizer steps between logged metrics", may_change=True)
    norm: NormSchema = doc(NormSchema, "group norm: the arm")
    placement: PlacementSchema = doc(PlacementSchema,
                                     "group placement: pre (GPT-2) or post (norm after each add)")
    size: SizeSchema = doc(SizeSchema, "group size: architecture and its defaults")
    optim: OptimSchema = doc(OptimSchema, "AdamW and the warm-up + cosine schedule")
    checkpoint: CheckpointSchema = doc(CheckpointSchema,
                                       "_target_ node of the checkpoint (and probe) schedule")
    data: DataSchema = doc(DataSchema, "group data: _target_ node of the data module")
    probe: TrainProbeSchema = doc(TrainProbeSchema, "group probe: the angle measurements")
    trainer: Any = doc(MISSING, "group trainer: _target_ node of lightning.Trainer",
                       may_change=TRAINER_MAY_CHANGE)
    logger: Any = doc(None, "group logger: name -> _target_ node of a Lightning logger", may_change=True)
    # How the run is planned and checked before it starts, not what it computes.
    plan: PlanSchema = doc(PlanSchema, "the memory and compute plan (python -m normgeo.plan) and the GPU "
                                       "pre-flight check", may_change=True)

    # What the keys imply, computed here once: every consumer asks the run's config, none recomputes it.
    @property
    def gpt(self) -> GPTConfig:
        """The model's architecture (its own check: check_train)."""
        size = self.size
        return GPTConfig(n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd,
                         block_size=self.seq_len, vocab_multiple=self.vocab_multiple, norm=self.norm.name,
                         norm_eps=self.norm.eps,
                         norm_impl=self.norm.impl, placement=self.placement.name,
                         tie_embeddings=self.tie_embeddings, dropout=self.dropout, bias=self.bias,
                         init_std=self.init_std)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def accumulation(self, world_size: int) -> int:
        """The accumulation steps of ``world_size`` devices; the one check that micro_batch x world_size
        divides global_batch (for the config, the plan, the Trainer)."""
        try:
            return accumulation_steps(self.global_batch, self.micro_batch, world_size)
        except ValueError as err:
            raise ConfigError(f"micro_batch={self.micro_batch}: {err}") from None


@schema
class AnalyzeModelSchema:
    kind: str = doc(MISSING, "hf (Hugging Face) | checkpoint (a train.py checkpoint)")
    path: str | None = doc(None, "Hub id or local directory (kind=hf)")
    gguf_file: str | None = doc(None, "a GGUF file, dequantized on load")
    packaged: str | None = doc(None, "smollm2 | minilm: a model shipped in a pip package")
    revision: str | None = doc(None, "Hub revision")
    checkpoint: str | None = doc(None, "a .ckpt of train.py (kind=checkpoint)")
    dtype: str = doc("auto", "auto | float32 | bfloat16 | float16 (angles are measured in float32)")
    device_map: str | None = doc(None, "auto: spread the model over all GPUs (needs accelerate)")
    trust_remote_code: bool = doc(False, "run the repository's model code")
    seq_len: Count = doc(1024, "tokens per sequence, capped at the model's maximum")
    batch_size: Count = doc(8, "sequences per forward pass")
    name: str | None = doc(None, "the records' model field and the output folder")


@schema
class AnalyzeSchema:
    output_root: str = doc("outputs", "results go to <output_root>/analyze/<model>")
    out_dir: str = doc(MISSING, "the output folder")
    device: str = doc("auto", "auto | cpu | cuda | cuda:N")
    progress: bool = doc(True, "a progress bar over the probe batches")
    model: AnalyzeModelSchema = doc(AnalyzeModelSchema, "group model: the model to measure")
    probe: ProbeConfig = doc(ProbeConfig, "group probe: the probe text and statistics")


class ConfigError(Refusal, ValueError):
    """A config value the schema's types allow but the run cannot use."""


def _expect(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={format_value(value)}: expected {expected}")


def check_types(cfg: DictConfig, kind: type, script: str) -> Any:
    """The composed config as a ``kind``, validated by pydantic; ConfigError names the first bad key, the one
    the user set rather than an interpolation of it (``max_steps: ${size.max_steps}``: size.max_steps)."""
    try:
        return TypeAdapter(kind).validate_python(OmegaConf.to_container(cfg, resolve=True))
    except ValidationError as err:
        errors = err.errors(include_url=False)
        error = next((e for e in errors if not _interpolated(cfg, e["loc"])), errors[0])
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                        for part in error["loc"]).lstrip(".")
        if error["type"] == "unexpected_keyword_argument":
            *parents, name = error["loc"]
            keys = [f.name for f in dataclasses.fields(_hint_at(kind, tuple(parents)))]  # the key's node
            close = difflib.get_close_matches(str(name), keys, n=1)
            hint = f"did you mean {where.removesuffix(str(name))}{close[0]}? " if close else ""
            raise ConfigError(f"{where}: no such key "
                              f"({hint}python {script} --help lists every key)") from None
        hint = _hint_at(kind, error["loc"])
        message = (f"expected {type_words(hint)}" if error["type"] in RANGE_ERRORS
                   else f"expected a finite {type_words(hint)}" if error["type"] == "finite_number"
                   else error["msg"])
        raise ConfigError(f"{where}={format_value(error['input'])}: {message}") from None


# pydantic's errors of a value outside its range: the message states the whole range, as --help does.
RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long")


def _hint_at(kind: type, loc: tuple) -> Any:
    """The declared type of the key at ``loc`` in the schema ``kind`` (a list element's, for an index)."""
    hint: Any = kind
    for part in loc:
        while typing.get_origin(hint) in (Annotated, typing.Union, types.UnionType):
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        hint = (typing.get_args(hint)[0] if isinstance(part, int)
                else typing.get_type_hints(hint, include_extras=True)[part])
    return hint


def _interpolated(cfg: DictConfig, loc: tuple) -> bool:
    """Whether the value at ``loc`` (or a node above it) is an interpolation of another key."""
    node: Any = cfg
    for part in loc:
        if not isinstance(node, DictConfig) or part not in node:
            return False
        if OmegaConf.is_interpolation(node, part):
            return True
        node = node[part]
    return False


def check_val_sequences(cfg: TrainSchema, val_tokens: int) -> None:
    """val_sequences against the prepared validation split's ``val_tokens`` (normgeo.runs.start)."""
    windows = val_tokens - cfg.seq_len  # distinct start offsets of a window of seq_len + 1 tokens
    _expect(cfg.val_sequences <= windows, "val_sequences", cfg.val_sequences,
            f"at most {max(windows, 0):,}: the validation split holds {val_tokens:,} tokens, so more "
            f"windows of seq_len={cfg.seq_len} only repeat them; lower val_sequences or prepare a "
            "larger data.val_fraction")


COSTLY_FRACTION = 0.25  # of the training's compute added by validation or the probe (costly_values)
COSTLY_STEPS_FACTOR = 10  # max_steps against the size's preset
COSTLY_PROBE_FACTOR = 1.0  # the null's products against the probe's own forward
COSTLY_REPLICATES_FACTOR = 10  # bootstrap replicates against the default
COSTLY_DISK_BYTES = 10 * 2**30  # the schedule's checkpoints
# Bytes per parameter of a checkpoint (float32): the weights, and AdamW's two moments besides.
WEIGHT_BYTES, OPTIMIZER_BYTES = 4, 8


def costly_values(cfg: TrainSchema, *, probes: int, checkpoints: int, parameters: int,
                  free_bytes: int | None = None) -> list[str]:
    """One line per legal but costly value with its estimated cost: ``probes``, how often the probe runs;
    ``checkpoints``, how many the schedule writes, of a model of ``parameters``, on a disk with
    ``free_bytes`` free."""
    step_tokens = cfg.tokens_per_step
    train_tokens = cfg.max_steps * step_tokens
    # A forward pass is about a third of a training step (forward + backward) per token.
    lines = []
    val_tokens = cfg.val_sequences * cfg.seq_len
    validations = cfg.max_steps // cfg.val_every
    if validations and validations * val_tokens / 3 > COSTLY_FRACTION * train_tokens:
        lines.append(f"val_sequences={cfg.val_sequences}: each of the {validations:,} validation(s) forwards "
                     f"{val_tokens:,} tokens, the compute of about {val_tokens / 3 / step_tokens:,.0f} "
                     f"training steps ({validations * val_tokens / 3 / train_tokens:.0%} of the training's)")
    probe, ckpt = cfg.probe, cfg.checkpoint
    if probe.enabled and probes * probe.tokens / 3 > COSTLY_FRACTION * train_tokens:
        schedule = (f"checkpoint.steps={ckpt.steps}" if ckpt.steps is not None else
                    f"checkpoint.dense_every={ckpt.dense_every} to dense_until={ckpt.dense_until}, "
                    f"sparse_every={ckpt.sparse_every}")
        lines.append(f"probe.tokens={probe.tokens}: each of the {probes:,} probes (one at every scheduled "
                     f"step: {schedule}) forwards {probe.tokens:,} tokens with hooks, at least the compute "
                     f"of {probe.tokens / 3 / step_tokens:,.0f} training steps "
                     f"({probes * probe.tokens / 3 / train_tokens:.0%} of the training's)")
    # At every norm input and output (about 4 a block), the angle with K null directions is a d x K product
    # per token; the probe's forward is about 12 d^2 multiply-adds a block per token.
    null_cost = 4 * probe.null_directions / (12 * cfg.size.n_embd)
    if probe.enabled and null_cost > COSTLY_PROBE_FACTOR:
        lines.append(f"probe.null_directions={probe.null_directions}: the null's products cost about "
                     f"{null_cost:,.1f}x the probe's forward at d={cfg.size.n_embd}, at each of the "
                     f"{probes:,} probes")
    default_replicates = BootstrapConfig.replicates  # the dataclass field's default
    if probe.enabled and probe.bootstrap.replicates > COSTLY_REPLICATES_FACTOR * default_replicates:
        lines.append(f"probe.bootstrap.replicates={probe.bootstrap.replicates}: "
                     f"{probe.bootstrap.replicates / default_replicates:,.0f}x the default "
                     f"{default_replicates:,}; every interval of each of the {probes:,} probes resamples "
                     "that many times")
    preset = cfg.size.max_steps
    if cfg.max_steps > COSTLY_STEPS_FACTOR * preset:
        lines.append(f"max_steps={cfg.max_steps}: {train_tokens:,} training tokens, "
                     f"{cfg.max_steps / preset:,.0f}x the {preset:,} steps of size={cfg.size.name}")
    full = parameters * (WEIGHT_BYTES + OPTIMIZER_BYTES)  # last.ckpt
    each = full if ckpt.keep_optimizer else parameters * WEIGHT_BYTES
    disk = checkpoints * each + full
    if disk > COSTLY_DISK_BYTES or (free_bytes is not None and disk > free_bytes):
        short = free_bytes is not None and disk > free_bytes
        free = f", more than the {free_bytes / 1e9:,.1f} GB free there" if short else ""
        lines.append(f"checkpoint: the schedule keeps {checkpoints:,} checkpoints of {each / 1e9:,.2f} GB "
                     f"and last.ckpt, about {disk / 1e9:,.1f} GB{free}; a larger checkpoint.sparse_every or "
                     "dense_every keeps fewer")
    return lines


PASSES_WARNED = 100  # passes over the training tokens: the run learns a small corpus by heart
CPU_PARAMETERS_WARNED = 100_000_000  # parameters trained on a CPU: a model sized for a GPU


def launch_cost(cfg: TrainSchema, *, parameters: int, train_tokens: int, device: str,
                precision: str) -> list[str]:
    """At most one line for a valid launch probably not meant (size=1b on a CPU): cost and what instead."""
    step_tokens = cfg.tokens_per_step
    passes = cfg.max_steps * step_tokens / max(train_tokens, 1)
    costs, instead = [], []
    if passes > PASSES_WARNED:
        costs.append(f"{cfg.max_steps:,} steps of {step_tokens:,} tokens are ~{passes:,.0f} passes over the "
                     f"{train_tokens:,} training tokens of data={cfg.data.name}")
        instead.append("data=openwebtext (prepared once, online: python -m corpus data=openwebtext) or fewer "
                       "max_steps")
    if device == "cpu" and parameters > CPU_PARAMETERS_WARNED:
        costs.append(f"a {parameters / 1e6:,.0f}M-parameter model trained in {precision} on the CPU")
        instead.append("a GPU machine (or size=tiny here)")
    if not costs:
        return []
    return [f"size={cfg.size.name}: {'; '.join(costs)}; run with {', and '.join(instead)} instead"]


def odd_values(cfg: TrainSchema) -> list[str]:
    """One line per valid setting probably not meant (the run goes on): a warm-up not shorter than the run."""
    warmup, max_steps = cfg.optim.warmup_steps, cfg.max_steps
    if warmup and warmup >= max_steps:
        return [
            f"optim.warmup_steps={warmup} is not fewer than max_steps={max_steps}: the learning rate "
            "rises for the whole run and "
            f"{'reaches its peak only at the last step' if warmup == max_steps else 'never reaches its peak'}"
            ", with no decay; optim.warmup_steps below max_steps (0: none) warms up, then decays"]
    return []


def unmeasured_values(cfg: TrainSchema) -> list[str]:
    """One line per measurement asked for that this run cannot make (it goes on): centering on DyT arms."""
    arm = NORM_ARMS.get(cfg.norm.name)
    scopes = cfg.probe.intervention
    if not (cfg.probe.enabled and scopes and arm is not None and arm.site_kind not in INTERVENABLE_KINDS):
        return []
    return [f"probe.intervention=[{','.join(scopes)}]: norm={arm.name} has no centering to take out or put "
            f"in (its norms are {arm.site_kind} sites, not {' or '.join(INTERVENABLE_KINDS)}), so no "
            "intervention is measured and no intervention.jsonl written; probe.intervention=[] says so"]


def training_device_type(trainer: dict[str, Any]) -> str:
    """"cuda" or "cpu": where trainer.accelerator puts the model (auto: a GPU when there is one)."""
    accelerator = str(trainer.get("accelerator", "auto"))
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "cuda" if on_gpu else "cpu"


def compiles(cfg: TrainSchema, device_type: str | None = None, *, planned: bool = False) -> bool:
    """Whether the run compiles, the one place compile=auto is decided: on for CUDA where a compiler works
    (1.1-1.8x faster on an H200, docs/training.md). ``planned`` on a login node: no compiler looked for."""
    if cfg.compile != "auto":
        return bool(cfg.compile)
    device_type = device_type or training_device_type(cfg.trainer)
    return device_type == "cuda" and (planned or compile_refusal(device_type) is None)


def compiler_refusal(cfg: TrainSchema) -> str | None:
    """Why this machine cannot compile what the run asks compiled, or None: refused rather than falling back,
    since a run that says compiled runs compiled. Not a config check: a plan runs where no compiler is."""
    wants = [(key, instead) for key, on, instead in (
        ("compile=true", cfg.compile is True, "compile=auto (eager where it cannot compile)"),
        ("norm.impl=compiled", cfg.norm.impl == "compiled", "train with norm.impl=stock")) if on]
    if wants and (refusal := compile_refusal(training_device_type(cfg.trainer))):
        return f"{wants[0][0]}: {refusal}; or {wants[0][1]}"
    return None


LOCAL_SOURCE = "corpus.sources.LocalFilesSource"


def check_intervention(probe: ProbeConfig) -> None:
    """probe.intervention: known scope kinds, each once."""
    kinds = probe.intervention
    _expect(all(kind in SCOPE_KINDS for kind in kinds) and len(set(kinds)) == len(kinds),
            "probe.intervention", kinds,
            f"a list of distinct scopes from {', '.join(SCOPE_KINDS)}, or [] for none, "
            "e.g. probe.intervention=[all,layers]")


def check_probe_source(probe: ProbeConfig) -> None:
    """probe=local's files, checked before anything is written: the probe reads them only mid-training."""
    source = probe.source
    if source.get("_target_") != LOCAL_SOURCE:
        return
    if source.get("path") in (None, MISSING):
        raise ConfigError("probe.path=null: expected the probe's local text for probe=local (a folder, "
                          "file or glob), e.g. probe.path=../shared/corpora/wikipedia")
    try:
        LocalFilesSource(str(source["path"]),
                         plain_text_extensions=tuple(source.get("plain_text_extensions") or ()),
                         config_node=str(source.get("config_node", "probe"))).check()
    except SourceError as err:
        raise ConfigError(str(err)) from None


def check_output_root(cfg: TrainSchema | AnalyzeSchema) -> None:
    """Every name that becomes a path, checked alike: an empty folder (an unset ``$OUT``) puts the outputs
    at the root or here; an empty, ``.`` or ``..`` run_name puts the run into output_root itself or above."""
    examples = {"output_root": "outputs", "run_dir": "outputs/my-run", "out_dir": "outputs/analyze/my-model",
                "data_root": "data"}
    for key, example in examples.items():
        if hasattr(cfg, key):
            _expect(str(getattr(cfg, key)).strip() != "", key, getattr(cfg, key),
                    f"a folder, e.g. {key}={example} (an unset shell variable gives an empty one)")
    if isinstance(cfg, TrainSchema):
        parts = str(cfg.run_name).replace("\\", "/").split("/")
        _expect(all(part.strip() not in ("", ".", "..") for part in parts), "run_name", cfg.run_name,
                "a folder name of its own under output_root, e.g. run_name=my-run (empty, '.' or '..' puts "
                "the run into output_root itself, beside data/ and the other runs, or above it)")


def check_data_path(cfg: DictConfig) -> None:
    """data=local without data.source.path, checked first: data.name and data.directory interpolate it."""
    if cfg.data.source.get("_target_") == LOCAL_SOURCE and OmegaConf.is_missing(cfg.data.source, "path"):
        raise ConfigError("data.source.path=???: data=local reads the folder, file or glob given as "
                          "data.source.path=..., e.g. data.source.path=../shared/corpora/webtext")


# The keys of the fields models.gpt.GPTConfig's own check refuses (TrainSchema.gpt), for its refusals.
ARCHITECTURE_KEYS = {"norm": "norm.name", "norm_impl": "norm.impl", "placement": "placement.name",
                     "n_head": "size.n_head"}


def check_train(composed: DictConfig) -> TrainSchema:
    """The composed config as the run's typed config, validated once; ConfigError for what cannot run."""
    check_data_path(composed)
    cfg: TrainSchema = check_types(composed, TrainSchema, "train.py")
    check_output_root(cfg)
    try:  # the model's own check, reported under the config's keys
        cfg.gpt  # noqa: B018 (built for its check)
    except ArchitectureError as err:
        key = ARCHITECTURE_KEYS[err.field]
        group = f" ({key.removesuffix('.name')}=...)" if key.endswith(".name") else ""  # norm=...
        raise ConfigError(f"{key}={format_value(err.value)}: expected {err.expected}{group}") from None
    _expect(isinstance(cfg.compile, bool) or cfg.compile == "auto", "compile", cfg.compile,
            "true, false or auto (on when training on CUDA)")
    steps = cfg.checkpoint.steps
    if steps is not None:
        _expect(all(a < b for a, b in zip(steps, steps[1:], strict=False)), "checkpoint.steps",
                steps, "positive, strictly increasing steps, e.g. checkpoint.steps=[500,1000]")
    _expect(cfg.resume in (None, "auto") or str(cfg.resume).endswith(".ckpt"), "resume", cfg.resume,
            "null, auto or the path of a .ckpt file")
    if refusal := unknown_tokenizer(cfg.data.tokenizer, "data.tokenizer"):
        raise ConfigError(refusal)
    # The rules between keys; check_val_sequences and accumulation need the data and devices the start learns.
    if steps is not None and (beyond := [s for s in steps if s > cfg.max_steps]):
        raise ConfigError(f"checkpoint.steps={format_value(steps)}: step {beyond[0]} is beyond "
                          f"max_steps={cfg.max_steps}; expected checkpoint steps <= max_steps")
    if cfg.probe.enabled and (refusal := cfg.probe.size_refusal(cfg.seq_len)):
        raise ConfigError(refusal)
    check_intervention(cfg.probe)
    check_probe_source(cfg.probe)
    cfg.accumulation(world_size=1)
    return cfg


def check_analyze(composed: DictConfig) -> AnalyzeSchema:
    """The composed config as analyze.py's typed config; ConfigError for a value it cannot run with."""
    cfg: AnalyzeSchema = check_types(composed, AnalyzeSchema, "analyze.py")
    check_output_root(cfg)
    _expect(cfg.model.kind in ("hf", "checkpoint"), "model.kind", cfg.model.kind, "hf or checkpoint")
    _expect(cfg.model.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype", cfg.model.dtype,
            "auto, float32, bfloat16 or float16")
    check_intervention(cfg.probe)
    _expect(re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(cfg.device)) is not None, "device", cfg.device,
            "auto, cpu, cuda or cuda:N")
    if refusal := missing_cuda("device", str(cfg.device), "device=cpu (or device=auto)"):
        raise ConfigError(refusal)
    check_probe_source(cfg.probe)
    return cfg


def key_docs(kind: type, prefix: str = "") -> list[str]:
    """``key: type = default  # doc`` for every key of a schema, nested nodes flattened (for --help)."""
    lines = []
    hints = typing.get_type_hints(kind, include_extras=True)
    for f in dataclasses.fields(kind):
        key, text = f"{prefix}{f.name}", f.metadata.get("doc", "")
        if dataclasses.is_dataclass(f.default_factory):
            lines += [f"{key}:  # {text}", *key_docs(f.default_factory, f"{key}.")]
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        lines.append(f"{key}: {type_words(hints[f.name])} = "
                     f"{'(from conf/)' if default == MISSING else format_value(default)}  # {text}")
    return lines


def type_words(hint: Any) -> str:
    """A key's type as --help shows it, with its range: ``int >= 1``, ``list[float >= 0, < 1] (2 items)``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Annotated:
        words = [type_words(args[0])]
        for limit in args[1:]:
            if isinstance(limit, Len):
                words.append(f"({limit.min_length} items)" if limit.min_length == limit.max_length else
                             f"({limit.min_length} to {limit.max_length} items)")
            else:
                words.append(", ".join(f"{op} {getattr(limit, name)}" for name, op in BOUNDS
                                       if getattr(limit, name, None) is not None))
        return " ".join(words)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(type_words(arg) for arg in args)
    if typing.get_origin(hint) is list:
        return f"list[{type_words(args[0])}]"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))

SCHEMAS = {"train": (TrainSchema, check_train), "analyze": (AnalyzeSchema, check_analyze)}


def register() -> None:
    for name, (kind, _) in SCHEMAS.items():
        ConfigStore.instance().store(name=f"{name}_schema", node=kind)
