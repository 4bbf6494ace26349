"""The plan of a composed train.py config, and train.py's pre-flight check with it: on a GPU, a config whose
planned peak memory cannot fit the device is refused before the run directory is claimed
(normgeo.runs.start). The planner itself is ``models/plan.py`` (fake tensors); ``python -m normgeo.plan``
prints its report."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from models.hardware import default_precision
from models.plan import TrainSetup, make_plan, preflight_error, quiet_plan
from normgeo.config.schema import ConfigError, check_accumulation, compiles
from normgeo.runs.build import module_arguments


class PlanRefusal(ValueError):
    """The planned peak cannot fit the GPU (train.py refuses the launch, exit 2)."""


def strategy_of(cfg: DictConfig, world_size: int) -> tuple[str, dict]:
    """single | ddp | fsdp2 (and FSDP2's settings) from ``trainer.strategy``, as Lightning would pick."""
    strategy = cfg.trainer.strategy
    if strategy in (None, "auto"):
        return ("ddp" if world_size > 1 else "single"), {}
    target = str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else str(strategy)
    if target.endswith("DDPStrategy") or target.startswith("ddp"):
        return "ddp", {}
    if target.endswith("FSDP2Strategy"):
        return "fsdp2", {"fsdp_param_dtype": strategy.get("param_dtype"),
                         "fsdp_reduce_dtype": strategy.get("reduce_dtype"),
                         "activation_checkpointing": bool(strategy.get("activation_checkpointing", False))}
    raise ConfigError(f"trainer.strategy={target}: cannot be planned (auto, DDPStrategy or FSDP2Strategy)")


def planned_world_size(cfg: DictConfig, visible_gpus: int | None = None) -> int:
    """GPUs of the run: trainer.devices (auto: plan.devices, the visible GPUs, or size.gpus) x num_nodes."""
    devices = cfg.trainer.devices
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif OmegaConf.is_list(devices):
        per_node = len(devices)
    else:
        per_node = cfg.plan.devices or visible_gpus or cfg.size.gpus or 1
    return per_node * int(cfg.trainer.num_nodes or 1)


def setup_from_config(cfg: DictConfig, visible_gpus: int | None = None) -> TrainSetup:
    """The planner's view of a composed train.py config (the model: LitGPT's arguments, as train.py builds
    it)."""
    world = planned_world_size(cfg, visible_gpus)
    strategy, fsdp = strategy_of(cfg, world)
    on_cpu = cfg.trainer.accelerator == "cpu"
    # trainer.precision=null: what default_precision() picks on the GPU (bf16 on every GPU planned for).
    precision = str(cfg.trainer.precision or ("32-true" if on_cpu else "bf16-mixed"))
    check_accumulation(cfg, world)
    # compile=auto as on the device planned for (a login node plans a GPU run).
    model = {**module_arguments(cfg), "compile": compiles(cfg, "cpu" if on_cpu else "cuda")}
    return TrainSetup(model=model, micro_batch=int(cfg.micro_batch), global_batch=int(cfg.global_batch),
                      precision=precision, strategy=strategy, world_size=world,
                      gradient_clip=cfg.trainer.get("gradient_clip_val"), fused_adamw=not on_cpu,
                      probe_batch=int(cfg.probe.batch_size), **fsdp)


def preflight(cfg: DictConfig) -> None:
    """The start's last check (normgeo.runs.start, before the claim): on a GPU, raise PlanRefusal when the
    planned peak cannot fit the device's memory. Skipped on the CPU and with plan.check=false."""
    if not cfg.plan.check or cfg.trainer.accelerator == "cpu" or not torch.cuda.is_available():
        return
    setup = setup_from_config(cfg, visible_gpus=torch.cuda.device_count())
    precision = str(cfg.trainer.precision or default_precision())
    setup = TrainSetup(**{**setup.__dict__, "precision": precision})
    with quiet_plan():
        plan = make_plan(setup, both_checkpointing=False, probe=False)
    device = torch.cuda.get_device_properties(0)
    error = preflight_error(plan, device.total_memory, device.name, headroom_gib=cfg.plan.headroom_gib,
                            fragmentation=cfg.plan.fragmentation)
    if error:
        raise PlanRefusal(error)
