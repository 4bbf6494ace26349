"""Sharded training with PyTorch's FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy.

FSDP2 shards every parameter as a DTensor along dim 0, keeps parameter names and shapes (so weight decay
by name, the probe's hooks and checkpoints see the bare model), and runs on CPU over gloo as well as on
GPUs over NCCL: the same code path is tested here and run on clusters.
"""

from __future__ import annotations

import logging

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models.gpt import GPT
from models.hardware import DTYPES

log = logging.getLogger(__name__)


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)} or null")
    return DTYPES[name]


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


class FSDP2Strategy(ModelParallelStrategy):
    """``fully_shard`` on each transformer block, then on the root model; full checkpoints.

    Args:
        param_dtype: dtype parameters are all-gathered and computed in (``bfloat16`` halves the
            all-gather traffic on GPUs); null keeps float32. Sharded master weights and the optimizer
            state stay float32 either way.
        reduce_dtype: dtype of the gradient reduce-scatter; float32 keeps the reduction exact.
        activation_checkpointing: recompute each block's activations in the backward pass
            (less memory, ~30% more compute), applied without renaming any parameter.
        reshard_after_forward: free the gathered parameters of a block after its forward (ZeRO-3);
            false keeps them until the backward (ZeRO-2-like: faster, more memory).

    Checkpoints are written as one full (unsharded) state dict gathered to rank 0, so ``analyze.py
    model=checkpoint``, a DDP run and a run with another number of devices all load them.
    """

    def __init__(
        self,
        *,
        param_dtype: str | None = None,
        reduce_dtype: str | None = "float32",
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(save_distributed_checkpoint=False, process_group_backend=process_group_backend)
        self.param_dtype = _dtype(param_dtype)
        self.reduce_dtype = _dtype(reduce_dtype)
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        # Pure data parallelism: one mesh dimension over every process of every node, no tensor parallelism.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def shard(self, model: GPT) -> None:
        """Apply FSDP2 to ``model`` in place (called from ``LitGPT.configure_model``)."""
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        for block in model.blocks:
            if self.activation_checkpointing:
                checkpoint(block)  # composable: no wrapper module, parameter names unchanged
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        # The root holds the embeddings, the final norm and the head; its forward is the one called.
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        log.info("FSDP2: %d blocks + root sharded over %d processes (param dtype %s, reduce dtype %s, "
                 "activation checkpointing %s)", len(model.blocks), mesh.size(), _name(self.param_dtype),
                 _name(self.reduce_dtype), self.activation_checkpointing)


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each block's forward, leaving FSDP2's hooks (in ``Module.__call__``) outside graphs."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward)
