"""The typed schema of train.py's and analyze.py's configs (Hydra structured configs in the ConfigStore).

The YAML files in conf/ keep the values; these dataclasses carry each key's type, default and a one-line
doc (``python train.py --help`` lists them). The schema is the first entry of each primary config's
defaults list, so a wrong type or an unknown key (``optim.lr=abc``, ``+max_stpes=10``) fails while Hydra
composes. What a type cannot say (sizes > 0, ``min_lr_ratio`` in [0, 1], increasing checkpoint steps, a
known norm) :func:`check_train` / :func:`check_analyze` say, before anything is written
(normgeo.runs.checks.ConfigCheck runs them).
"""

from __future__ import annotations

import difflib
import functools
import importlib
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from models.gpt import PLACEMENTS
from models.norms import NORM_ARMS, NORM_IMPLS, compile_refusal


def doc(default: Any, text: str) -> Any:
    """A dataclass field with its one-line doc; a list default is copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


def node(kind: type, text: str) -> Any:
    return field(default_factory=kind, metadata={"doc": text})


@dataclass
class NormSchema:
    name: str = doc(MISSING, f"the norm of every block and the final norm: {' | '.join(NORM_ARMS)}")
    eps: float = doc(1e-5, "added to the variance (LayerNorm) or mean square (RMSNorm)")
    impl: str = doc("stock", f"how every norm runs: {' | '.join(NORM_IMPLS)} (torch.compile of each norm's forward)")


@dataclass
class PlacementSchema:
    name: str = doc(MISSING, f"where the norms sit in a block: {' | '.join(PLACEMENTS)}")
    run_suffix: str = doc("", "appended to the norm in run names (pre-norm runs keep their names)")


@dataclass
class SizeSchema:
    name: str = doc(MISSING, "the size's name (run names, wandb group)")
    n_layer: int = doc(MISSING, "transformer blocks")
    n_head: int = doc(MISSING, "attention heads; must divide n_embd")
    n_embd: int = doc(MISSING, "model width d")
    seq_len: int = doc(MISSING, "default of the top-level seq_len")
    lr: float = doc(MISSING, "default peak learning rate (optim.lr)")
    warmup_steps: int = doc(MISSING, "default warm-up (optim.warmup_steps)")
    max_steps: int = doc(MISSING, "default max_steps")
    micro_batch: int = doc(MISSING, "default micro_batch")
    gpus: int | None = doc(None, "GPUs per SLURM job (hydra/launcher=slurm)")
    minutes: int = doc(60, "SLURM time limit per job, minutes")


@dataclass
class OptimSchema:
    lr: float = doc(MISSING, "peak learning rate, > 0")
    min_lr_ratio: float = doc(0.1, "cosine decay ends at this fraction of the peak, in [0, 1]")
    warmup_steps: int = doc(MISSING, "linear warm-up steps, >= 0")
    weight_decay: float = doc(0.1, "AdamW weight decay on matrices, >= 0")
    betas: list[float] = doc([0.9, 0.95], "AdamW betas, two values in [0, 1)")


@dataclass
class CheckpointSchema:
    _target_: str = doc(MISSING, "the schedule's class (callbacks.checkpointing.CheckpointSchedule)")
    max_steps: int = doc(MISSING, "the schedule ends with this step: the top-level max_steps")
    steps: list[int] | None = doc(None, "explicit checkpoint/probe steps, positive and increasing")
    dense_every: int = doc(1000, "a checkpoint every this many steps up to dense_until")
    dense_until: int = doc(10000, "end of the dense part of the schedule")
    sparse_every: int = doc(10000, "a checkpoint every this many steps after it")
    last_every: int = doc(500, "refresh last.ckpt (for resuming) this often; 0: only at scheduled steps")
    keep_optimizer: bool = doc(False, "scheduled checkpoints keep the optimizer state too")


@dataclass
class BootstrapSchema:
    replicates: int = doc(1000, "bootstrap replicates for the 95% intervals of null.jsonl")
    block: int = doc(1, "consecutive probe sequences per resampled block")


@dataclass
class ProbeSchema:
    """The probe keys train.py and analyze.py share (conf/shared/probe/ presets)."""

    source: Any = doc(MISSING, "_target_ node of the probe text (corpus.sources)")
    path: str | None = doc(None, "local files for probe=local")
    plain_text_extensions: list[str] = doc([], "probe=local: other extensions read as plain text, e.g. [.md]")
    tokens: int = doc(MISSING, "probe tokens per measurement")
    seed: int = doc(1234, "reference vectors, null directions, document sampling and bootstrap")
    include_standardized: bool = doc(True, "also measure LayerNorm's standardization (.std sites)")
    null_directions: int = doc(64, "random unit directions that 1 is compared with; 0: none")
    sample: bool = doc(True, "documents in a seeded order over the whole source")
    min_doc_tokens: int = doc(0, "skip documents shorter than this (title-only stubs)")
    bootstrap: BootstrapSchema = node(BootstrapSchema, "95% intervals over probe sequences")


@dataclass
class TrainProbeSchema(ProbeSchema):
    """train.py's probe: the shared keys, and two that only training has (analyze.py always measures, in
    batches of model.batch_size), so that ``analyze.py --help`` lists no key it would ignore."""

    enabled: bool = doc(True, "measure the angles at every scheduled step")
    batch_size: int = doc(8, "probe sequences per forward pass")


@dataclass
class DataSchema:
    _target_: str = doc(MISSING, "the data module's class (corpus.datamodule.TokenDataModule)")
    name: str = doc(MISSING, "the corpus's name (its prepared folder)")
    source: Any = doc(MISSING, "_target_ node of the training text (corpus.sources); data=local: path, "
                      "text_field, plain_text_extensions (other extensions read as plain text, e.g. [.md])")
    directory: str = doc(MISSING, "where the prepared token files live")
    tokenizer: str = doc("gpt2", "tiktoken encoding")
    val_fraction: float = doc(0.005, "fraction of documents held out for validation, in (0, 1)")
    auto_prepare: bool = doc(True, "prepare on the fly when missing (else refuse and name the command)")
    prepare_command: str = doc("", "the command that prepares this corpus")
    seq_len: int = doc(MISSING, "filled from the top level")
    global_batch: int = doc(MISSING, "filled from the top level")
    micro_batch: int = doc(MISSING, "filled from the top level")
    max_steps: int = doc(MISSING, "filled from the top level")
    seed: int = doc(MISSING, "filled from the top level")
    val_sequences: int = doc(MISSING, "filled from the top level")
    num_workers: int = doc(MISSING, "filled from the top level")


@dataclass
class PlanSchema:
    check: bool = doc(True, "on a GPU, refuse a launch whose planned peak memory cannot fit (exit 2)")
    mfu: float = doc(0.4, "model FLOPs utilization for the planned time and GPU-hours, in (0, 1]")
    headroom_gib: float = doc(1.5, "GiB per GPU for the CUDA context and NCCL, >= 0")
    fragmentation: float = doc(0.1, "allocator fragmentation margin on the planned peak, >= 0")
    devices: int | None = doc(None, "GPUs per node planned for when trainer.devices=auto (null: size.gpus)")
    gpus: list[str] = doc(["a6000", "a100-40gb", "a100-80gb", "h100-80gb"], "GPU types to plan for (models/plan.py)")


@dataclass
class TrainSchema:
    seed: int = doc(0, "weights, data order and dropout")
    run_name: str = doc(MISSING, "the run directory's name")
    output_root: str = doc("outputs", "where run directories go")
    run_dir: str = doc(MISSING, "the run directory")
    data_root: str = doc(MISSING, "where prepared corpora go (env NORMGEO_DATA, default ./data)")
    resume: str | None = doc(None, "null: refuse a directory with checkpoints; auto: continue; or a .ckpt path")
    stop_at_step: int | None = doc(None, "end this session after this optimizer step (> 0; resumable)")
    max_steps: int = doc(MISSING, "optimizer steps of the whole run, > 0")
    global_batch: int = doc(64, "sequences per optimizer step over all devices, > 0")
    micro_batch: int = doc(MISSING, "sequences per device per forward pass; divides global_batch")
    seq_len: int = doc(MISSING, "tokens per sequence (the model's context)")
    num_workers: int = doc(0, "DataLoader workers, >= 0")
    compile: bool = doc(False, "torch.compile the model")
    tie_embeddings: bool = doc(False, "tie the input and output embeddings")
    val_every: int = doc(1000, "optimizer steps between validations, > 0")
    val_sequences: int = doc(64, "validation sequences, > 0")
    log_every: int = doc(10, "optimizer steps between logged metrics, > 0")
    norm: NormSchema = node(NormSchema, "group norm: the arm")
    placement: PlacementSchema = node(PlacementSchema, "group placement: pre (GPT-2) or post (norm after each add)")
    size: SizeSchema = node(SizeSchema, "group size: architecture and its defaults")
    optim: OptimSchema = node(OptimSchema, "AdamW and the warm-up + cosine schedule")
    checkpoint: CheckpointSchema = node(CheckpointSchema, "_target_ node of the checkpoint (and probe) schedule")
    model: Any = doc(MISSING, "_target_ node of the LightningModule (models.lit.LitGPT): the one cfg -> model map")
    data: DataSchema = node(DataSchema, "group data: _target_ node of the data module")
    probe: TrainProbeSchema = node(TrainProbeSchema, "group probe: the angle measurements")
    trainer: Any = doc(MISSING, "group trainer: _target_ node of lightning.Trainer")
    logger: Any = doc(None, "group logger: name -> _target_ node of a Lightning logger")
    plan: PlanSchema = node(PlanSchema, "the memory and compute plan (python -m normgeo.plan) and the GPU pre-flight check")


@dataclass
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
    seq_len: int = doc(1024, "tokens per sequence, capped at the model's maximum")
    batch_size: int = doc(8, "sequences per forward pass")
    name: str | None = doc(None, "the records' model field and the output folder")


@dataclass
class AnalyzeSchema:
    output_root: str = doc("outputs", "results go to <output_root>/analyze/<model>")
    out_dir: str = doc(MISSING, "the output folder")
    device: str = doc("auto", "auto | cpu | cuda | cuda:N")
    progress: bool = doc(True, "a progress bar over the probe batches")
    model: AnalyzeModelSchema = node(AnalyzeModelSchema, "group model: the model to measure")
    probe: ProbeSchema = node(ProbeSchema, "group probe: the probe text and statistics")


class ConfigError(ValueError):
    """A config value the schema's types allow but the run cannot use."""


def _expect(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        shown = OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value
        shown = "null" if shown is None else str(shown).lower() if isinstance(shown, bool) else shown
        raise ConfigError(f"{key}={shown}: expected {expected}")


def _positive(cfg: DictConfig, *keys: str, minimum: int = 1) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        _expect(value is not None and value >= minimum, key, value, f"an integer >= {minimum}")


def _unknown_keys(cfg: DictConfig, schema: type, script: str, prefix: str = "") -> None:
    """Hydra lets ``+key=value`` add a key even to a structured config: refuse a key the schema lacks."""
    known = {f.name: f for f in fields(schema)}
    for key, _ in cfg.items_ex(resolve=False):
        dotted = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean {prefix}{close[0]}? " if close else ""
            raise ConfigError(f"{dotted}: no such key ({hint}python {script} --help lists every key)")
        factory = known[key].default_factory
        if factory is not NO_DEFAULT and is_dataclass(factory) and isinstance(cfg._get_node(key), DictConfig):
            _unknown_keys(cfg._get_node(key), factory, script, f"{dotted}.")


# Lightning's precision values (lightning.fabric.connector's precision Literal; tests compare the two),
# and null: train.py picks bf16-mixed or 32-true for the hardware (models/hardware.py).
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "transformer-engine",
              "transformer-engine-float16")
PRECISION_SHORT = ("32", "16", "bf16", "64", 32, 16, 64)  # Lightning's aliases of 32-true, 16-mixed, ...
DEVICES_EXPECTED = "a device count >= 1, -1 (all), auto, or device indices like [0,1] or '0,1'"


def _devices_ok(devices: Any) -> bool:
    """Lightning's devices: a count, -1 (all), auto, a list of indices or a comma-separated string of them."""
    if isinstance(devices, bool):
        return False
    if isinstance(devices, int):
        return devices >= 1 or devices == -1
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return True
        if "," not in text:  # a count, as a string
            return text.isdigit() and int(text) >= 1
        parts = [part.strip() for part in text.split(",") if part.strip()]  # indices: "0,1" or "1,"
        return bool(parts) and all(part.isdigit() for part in parts)
    if isinstance(devices, ListConfig | list):
        return len(devices) > 0 and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    return False


def check_trainer(trainer: DictConfig) -> None:
    """The Trainer arguments Lightning itself would refuse inside ``instantiate`` (exit 1, after Hydra
    wrote .hydra/ and train.log): devices, num_nodes, precision, accelerator, strategy; checked by name,
    without building a Trainer (a strategy node's class is located, not constructed)."""
    # Lightning's public registries: the names its Trainer accepts (its own check, asked, not copied).
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import Strategy, StrategyRegistry

    _expect(_devices_ok(trainer.get("devices", "auto")), "trainer.devices", trainer.get("devices"), DEVICES_EXPECTED)
    nodes = trainer.get("num_nodes", 1)
    _expect(isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1, "trainer.num_nodes", nodes,
            "an integer >= 1")
    precision = trainer.get("precision")
    _expect(precision is None or precision in (*PRECISIONS, *PRECISION_SHORT), "trainer.precision", precision,
            f"null (bf16-mixed on GPUs that have it, else 32-true), {', '.join(PRECISIONS)} (or 32, 16, bf16, 64)")
    accelerators = ["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())]
    accelerator = trainer.get("accelerator", "auto")
    _expect(accelerator in accelerators, "trainer.accelerator", accelerator, f"one of {', '.join(accelerators)}")
    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, DictConfig):
        target = strategy.get("_target_")
        module, _, name = str(target).rpartition(".")
        try:  # import the module, build nothing
            located = getattr(importlib.import_module(module), name, None) if module else None
        except ImportError:
            located = None
        _expect(isinstance(located, type) and issubclass(located, Strategy), "trainer.strategy._target_", target,
                "the import path of a lightning.pytorch.strategies.Strategy subclass")
        return
    strategies = ["auto", *StrategyRegistry.available_strategies()]
    _expect(isinstance(strategy, str) and strategy.lower() in strategies, "trainer.strategy", strategy,
            "auto, ddp, ddp_spawn, fsdp, deepspeed or another name of Lightning's StrategyRegistry, "
            "or a _target_ node (trainer=ddp, trainer=fsdp)")


def training_device_type(trainer: DictConfig) -> str:
    """"cuda" or "cpu": where trainer.accelerator puts the model (auto: a GPU when there is one)."""
    import torch

    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


LOCAL_SOURCE = "corpus.sources.LocalFilesSource"


@functools.lru_cache(maxsize=16)
def _local_files_refusal(path: str, extensions: tuple[str, ...], config_node: str) -> str | None:
    """Why a local source cannot be read (a missing path, files of unsupported types), or None; cached:
    one launch checks its config several times (normgeo.runs.checks, normgeo.runs.session)."""
    from corpus.sources import LocalFilesSource, SourceError

    try:
        LocalFilesSource(path, plain_text_extensions=extensions, config_node=config_node).check()
    except SourceError as err:
        return str(err)
    return None


def check_probe_source(probe: DictConfig) -> None:
    """probe=local's files, before anything is written: the probe reads them only once training started
    (data=local's are checked by its prepare, which runs before anything is written)."""
    source = probe.source
    if source.get("_target_") != LOCAL_SOURCE:
        return
    if OmegaConf.is_missing(source, "path") or source.path is None:
        raise ConfigError("probe.path=null: expected the probe's local text for probe=local (a folder, file or "
                          "glob), e.g. probe.path=../shared/corpora/wikipedia")
    refusal = _local_files_refusal(str(source.path), tuple(source.get("plain_text_extensions") or ()),
                                   str(source.get("config_node", "probe")))
    if refusal:
        raise ConfigError(refusal)


def check_train(cfg: DictConfig) -> None:
    """Raise ConfigError (key, value, what is expected) for a value train.py cannot run with."""
    from corpus.stream import accumulation_steps  # the one divisibility rule (also StepSampler's)

    _unknown_keys(cfg, TrainSchema, "train.py")
    _positive(cfg, "max_steps", "global_batch", "micro_batch", "seq_len", "val_every", "val_sequences", "log_every")
    _positive(cfg, "size.n_layer", "size.n_head", "size.n_embd", "checkpoint.dense_every", "checkpoint.sparse_every")
    _positive(cfg, "checkpoint.dense_until", "probe.tokens", "probe.batch_size", "probe.bootstrap.replicates")
    _positive(cfg, "probe.bootstrap.block")
    _positive(cfg, "num_workers", "optim.warmup_steps", "checkpoint.last_every", "probe.null_directions", minimum=0)
    _positive(cfg, "probe.min_doc_tokens", minimum=0)
    _expect(cfg.stop_at_step is None or cfg.stop_at_step > 0, "stop_at_step", cfg.stop_at_step,
            "a step > 0, or null to run to max_steps")
    _expect(cfg.norm.name in NORM_ARMS, "norm.name", cfg.norm.name, f"one of {', '.join(NORM_ARMS)} (norm=...)")
    _expect(cfg.norm.eps > 0, "norm.eps", cfg.norm.eps, "a number > 0")
    _expect(cfg.norm.impl in NORM_IMPLS, "norm.impl", cfg.norm.impl, " or ".join(NORM_IMPLS))
    if cfg.norm.impl == "compiled":
        # Refused at the start rather than falling back: a run that says compiled runs compiled.
        refusal = compile_refusal(training_device_type(cfg.trainer))
        if refusal:
            raise ConfigError(f"norm.impl=compiled: {refusal}; or train with norm.impl=stock")
    _expect(cfg.placement.name in PLACEMENTS, "placement.name", cfg.placement.name,
            f"one of {', '.join(PLACEMENTS)} (placement=...)")
    _expect(cfg.size.n_embd % cfg.size.n_head == 0, "size.n_head", cfg.size.n_head,
            f"a divisor of size.n_embd={cfg.size.n_embd}")
    _expect(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "a learning rate > 0, e.g. optim.lr=3e-4")
    _expect(0 <= cfg.optim.min_lr_ratio <= 1, "optim.min_lr_ratio", cfg.optim.min_lr_ratio, "a number in [0, 1]")
    _expect(cfg.optim.weight_decay >= 0, "optim.weight_decay", cfg.optim.weight_decay, "a number >= 0")
    betas = list(cfg.optim.betas)
    _expect(len(betas) == 2 and all(0 <= b < 1 for b in betas), "optim.betas", cfg.optim.betas,
            "two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")
    steps = cfg.checkpoint.steps
    if steps is not None:
        _expect(all(s > 0 for s in steps) and all(a < b for a, b in zip(steps, steps[1:], strict=False)), "checkpoint.steps",
                steps, "positive, strictly increasing steps, e.g. checkpoint.steps=[500,1000]")
    _expect(0 < cfg.plan.mfu <= 1, "plan.mfu", cfg.plan.mfu, "a fraction in (0, 1]")
    _expect(cfg.plan.headroom_gib >= 0 and cfg.plan.fragmentation >= 0, "plan.headroom_gib",
            cfg.plan.headroom_gib, "a number >= 0 (and plan.fragmentation >= 0)")
    _expect(cfg.plan.devices is None or cfg.plan.devices > 0, "plan.devices", cfg.plan.devices, "an integer > 0 or null")
    _expect(0 < cfg.data.val_fraction < 1, "data.val_fraction", cfg.data.val_fraction, "a fraction in (0, 1)")
    _expect(cfg.resume in (None, "auto") or str(cfg.resume).endswith(".ckpt"), "resume", cfg.resume,
            "null, auto or the path of a .ckpt file")
    check_trainer(cfg.trainer)
    if cfg.data.source.get("_target_") == LOCAL_SOURCE and OmegaConf.is_missing(cfg.data.source, "path"):
        raise ConfigError("data.source.path=???: data=local reads the folder, file or glob given as "
                          "data.source.path=..., e.g. data.source.path=../shared/corpora/webtext")
    check_probe_source(cfg.probe)
    try:
        accumulation_steps(cfg.global_batch, cfg.micro_batch, world_size=1)
    except ValueError as err:
        raise ConfigError(f"micro_batch={cfg.micro_batch}: {err}") from None


def check_analyze(cfg: DictConfig) -> None:
    """Raise ConfigError for a value analyze.py cannot run with."""
    _unknown_keys(cfg, AnalyzeSchema, "analyze.py")
    _positive(cfg, "model.seq_len", "model.batch_size", "probe.tokens", "probe.bootstrap.replicates")
    _positive(cfg, "probe.bootstrap.block")
    _positive(cfg, "probe.null_directions", "probe.min_doc_tokens", minimum=0)
    _expect(cfg.model.kind in ("hf", "checkpoint"), "model.kind", cfg.model.kind, "hf or checkpoint")
    _expect(cfg.model.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype", cfg.model.dtype,
            "auto, float32, bfloat16 or float16")
    check_probe_source(cfg.probe)


def key_docs(schema: type, prefix: str = "") -> list[str]:
    """``key: type = default  # doc`` for every key of a schema, nested nodes flattened (for --help)."""
    lines = []
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        if f.default_factory is not NO_DEFAULT and is_dataclass(kind := f.default_factory):
            lines.append(f"{key}:  # {f.metadata.get('doc', '')}")
            lines += key_docs(kind, f"{key}.")
            continue
        default = f.default_factory() if f.default_factory is not NO_DEFAULT else f.default
        shown = "(from conf/)" if default == MISSING else "null" if default is None else default
        shown = str(shown).lower() if isinstance(shown, bool) else shown
        kind = str(f.type).replace("typing.", "")
        lines.append(f"{key}: {kind} = {shown}  # {f.metadata.get('doc', '')}")
    return lines


SCHEMAS = {"train": (TrainSchema, check_train), "analyze": (AnalyzeSchema, check_analyze)}


def register() -> None:
    store = ConfigStore.instance()
    for name, (schema, _) in SCHEMAS.items():
        store.store(name=f"{name}_schema", node=schema)
