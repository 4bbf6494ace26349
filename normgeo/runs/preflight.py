"""The plan of a run's config (the planner: ``models/step_cost.py``, on fake tensors) and train.py's
pre-flight check with it, the launch gate (:func:`models.step_cost.gate`): on a GPU (or against
``plan.device_memory_gib``) a config whose least memory cannot fit is refused before the claim; one whose
planned peak may not is warned about and starts. Rank 0 plans once per run; the plan is kept in
``<run_dir>/plan.json`` with a hash of what it planned, which other ranks and later sessions read while
the hash matches."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from corpus.atomic import atomic_open
from corpus.refusal import Refusal
from models.hardware import default_precision
from models.step_cost import GIB, GatePlan, TrainSetup, gate, quiet_plan, traced_gate_plan
from normgeo.config.schema import ConfigError, TrainSchema, compiles
from normgeo.run_folder import RunFolder
from normgeo.runs.run_config import is_rank_zero

log = logging.getLogger(__name__)


class PlanRefusal(Refusal, ValueError):
    """The planned peak cannot fit the GPU (train.py refuses the launch, exit 2)."""


def strategy_of(cfg: TrainSchema, world_size: int) -> tuple[str, dict]:
    """single | ddp | fsdp2 (and FSDP2's settings) from ``trainer.strategy``, as Lightning would pick."""
    strategy = cfg.trainer.get("strategy")
    if strategy in (None, "auto"):
        return ("ddp" if world_size > 1 else "single"), {}
    target = str(strategy.get("_target_", "")) if isinstance(strategy, dict) else str(strategy)
    if target.endswith("DDPStrategy") or target.startswith("ddp"):
        return "ddp", {}
    if target.endswith("FSDP2Strategy"):
        return "fsdp2", {"fsdp_param_dtype": strategy.get("param_dtype"),
                         "fsdp_reduce_dtype": strategy.get("reduce_dtype"),
                         "activation_checkpointing": bool(strategy.get("activation_checkpointing", False))}
    raise ConfigError(f"trainer.strategy={target}: cannot be planned (auto, DDPStrategy or FSDP2Strategy)")


def planned_world_size(cfg: TrainSchema, visible_gpus: int | None = None) -> int:
    """GPUs of the run: trainer.devices (auto: plan.devices, the visible GPUs, or size.gpus) x num_nodes."""
    devices = cfg.trainer.get("devices")
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, list):
        per_node = len(devices)
    else:
        per_node = cfg.plan.devices or visible_gpus or cfg.size.gpus or 1
    return per_node * int(cfg.trainer.get("num_nodes") or 1)


def setup_from_config(cfg: TrainSchema, visible_gpus: int | None = None) -> TrainSetup:
    """The planner's view of a run's config (its model and AdamW as train.py builds them)."""
    world = planned_world_size(cfg, visible_gpus)
    strategy, fsdp = strategy_of(cfg, world)
    on_cpu = cfg.trainer.get("accelerator") == "cpu"
    # trainer.precision=null: what default_precision() picks on the GPU (bf16 on every GPU planned for).
    precision = str(cfg.trainer.get("precision") or ("32-true" if on_cpu else "bf16-mixed"))
    cfg.accumulation(world)
    # compile=auto as on the device planned for: a login node without Triton plans a GPU run compiled.
    compiled = compiles(cfg, "cpu" if on_cpu else "cuda", planned=True)
    return TrainSetup(model=cfg.gpt, optim=cfg.optim, micro_batch=cfg.micro_batch,
                      global_batch=cfg.global_batch, precision=precision, strategy=strategy, world_size=world,
                      gradient_clip=cfg.trainer.get("gradient_clip_val"), fused_adamw=not on_cpu,
                      probe_batch=cfg.probe.batch_size, compiled=compiled, **fsdp)


@dataclass(frozen=True)
class KeptPlan:
    """A gate plan and the hash of what it planned: ``<run_dir>/plan.json``."""

    inputs_hash: str
    inputs: dict
    plan: GatePlan


def read_kept_plan(run_dir: Path, inputs_hash: str) -> GatePlan | None:
    """The plan kept in ``run_dir`` for these inputs; None when there is none, unreadable or another's."""
    try:
        data = json.loads(RunFolder(run_dir).plan.read_text(encoding="utf-8"))
        if data.get("inputs_hash") != inputs_hash:
            return None
        return GatePlan(**data["plan"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def write_kept_plan(run_dir: Path, kept: KeptPlan) -> None:
    """Rank 0, once the start is accepted (normgeo.runs.start.open_run_files)."""
    with atomic_open(RunFolder(run_dir).plan, "w", encoding="utf-8") as handle:
        json.dump(asdict(kept), handle, indent=1, default=str)


def preflight(cfg: TrainSchema) -> KeptPlan | None:
    """The start's last check: PlanRefusal when even the plan's lower bound cannot fit the device (the memory
    of ``plan.device_memory_gib``, else the GPU's), a warning when the planned peak may not; the plan to keep
    (None: nothing checked: plan.check=false, or the CPU without plan.device_memory_gib)."""
    cuda = cfg.trainer.get("accelerator") != "cpu" and torch.cuda.is_available()
    gib = cfg.plan.device_memory_gib
    if not cfg.plan.check or (gib is None and not cuda):
        return None
    if gib is not None:
        total_memory, device_name = int(float(gib) * GIB), f"plan.device_memory_gib={float(gib):g}"
    else:
        device = torch.cuda.get_device_properties(0)
        total_memory, device_name = device.total_memory, device.name
    setup = setup_from_config(cfg, visible_gpus=torch.cuda.device_count() if cuda else None)
    if cuda:  # precision=null as this GPU resolves it
        setup = replace(setup, precision=str(cfg.trainer.get("precision") or default_precision()))
    inputs = {"setup": asdict(setup), "torch": torch.__version__}  # what the plan depends on
    inputs_hash = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    planned = read_kept_plan(Path(cfg.run_dir), inputs_hash)
    # A kept plan of one traced micro_batch (it fit the card it was planned for) is traced again where it
    # does not fit this card: the gate then names the largest micro_batch that does.
    headroom = cfg.plan.headroom_gib
    if planned is None or (planned.per_sample is None and not planned.peak_fits(total_memory, headroom)):
        if not is_rank_zero():  # rank 0 plans and decides; its plan is kept for the others
            return None
        with quiet_plan():
            planned = traced_gate_plan(setup, total_memory, headroom)
    decision = gate(planned, total_memory, device_name, headroom_gib=headroom,
                    fragmentation=cfg.plan.fragmentation)
    if decision.refusal:
        raise PlanRefusal(decision.refusal)
    if decision.warning:
        log.warning("plan: %s", decision.warning)
    return KeptPlan(inputs_hash, inputs, planned)
