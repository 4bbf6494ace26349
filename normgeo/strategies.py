"""Strategy factories for configs that cannot name Python classes directly."""

from __future__ import annotations

from lightning.pytorch.strategies import FSDPStrategy

from models.gpt import Block


def fsdp(sharding_strategy: str = "FULL_SHARD", **kwargs) -> FSDPStrategy:
    """FSDP wrapping each transformer block; full (unsharded) checkpoints, readable by analyze.py."""
    return FSDPStrategy(
        auto_wrap_policy={Block},
        activation_checkpointing_policy=kwargs.pop("activation_checkpointing_policy", None),
        sharding_strategy=sharding_strategy,
        state_dict_type="full",
        **kwargs,
    )
