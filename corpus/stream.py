"""The batch stream: which token windows a global step trains on, as a pure function of (data, seed, step).

At optimizer step ``s`` the global batch is ``global_batch`` windows whose start offsets are drawn from
``numpy.random.default_rng([seed, s])``. Ranks and accumulation micro-steps only partition that list,
so any number of devices that divides the global batch sees the same tokens, and a resumed run
continues exactly where it stopped (the sampler starts at the trainer's restored global step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


def window_offsets(seed: int, step: int, count: int, num_tokens: int, window: int) -> np.ndarray:
    """Start offsets of the ``count`` windows of ``window`` tokens trained on at ``step``."""
    high = num_tokens - window
    if high <= 0:
        raise ValueError(f"{num_tokens} tokens are too few for windows of {window} tokens")
    return np.random.default_rng([seed, step]).integers(0, high, size=count)


class TokenWindows(Dataset):
    """Item ``i`` is window ``i % global_batch`` of step ``i // global_batch``: (input, shifted target).

    A validation set is the windows of step 0 with ``global_batch`` set to its size.
    """

    def __init__(self, path: str, num_tokens: int, seq_len: int, global_batch: int, seed: int) -> None:
        self.path = path
        self.num_tokens = num_tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self._tokens: np.memmap | None = None  # opened lazily: one memmap per worker process
        self._step_offsets: tuple[int, np.ndarray] | None = None  # the latest step's draw, for its windows

    def __len__(self) -> int:  # nominal: the stream is unbounded, samplers decide what is read
        return self.global_batch

    def offset(self, index: int) -> int:
        step, slot = divmod(index, self.global_batch)
        if self._step_offsets is None or self._step_offsets[0] != step:  # one draw per step, not per window
            self._step_offsets = (
                step, window_offsets(self.seed, step, self.global_batch, self.num_tokens, self.seq_len + 1))
        return int(self._step_offsets[1][slot])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = self.offset(index)
        chunk = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def tokens_per_step(global_batch: int, seq_len: int) -> int:
    """Tokens of one optimizer step over all devices (the ``tokens_seen`` unit of metrics and records)."""
    return global_batch * seq_len


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step: the global batch is fixed, accumulation fills what devices leave."""
    if global_batch % (micro_batch * world_size):
        raise ValueError(
            f"global batch {global_batch} is not divisible by micro batch {micro_batch} x {world_size} "
            "devices: choose a micro batch and device count whose product divides it"
        )
    return global_batch // (micro_batch * world_size)


class StepSampler(Sampler[int]):
    """Yields this rank's share of each global batch, step after step, from the current global step.

    Within one step the global batch of ``G = world * accumulation * micro`` windows is cut into
    micro-batches in order: micro-step ``a`` of rank ``r`` takes windows ``[(a*world + r)*micro, +micro)``.
    """

    def __init__(self, *, global_batch: int, micro_batch: int, rank: int, world_size: int, max_steps: int,
                 start_step: Callable[[], int]) -> None:
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.rank = rank
        self.world_size = world_size
        self.accumulation = accumulation_steps(global_batch, micro_batch, world_size)
        self.max_steps = max_steps
        self.start_step = start_step

    def __len__(self) -> int:
        # The whole run is one epoch of this length; a resumed session iterates only the remainder.
        # Lightning restores the epoch's batch counter (global_step x accumulation), so the two agree.
        return self.max_steps * self.accumulation * self.micro_batch

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start_step(), self.max_steps):
            base = step * self.global_batch
            for micro_step in range(self.accumulation):
                first = (micro_step * self.world_size + self.rank) * self.micro_batch
                yield from range(base + first, base + first + self.micro_batch)


class ShardSampler(Sampler[int]):
    """A fixed list of indices, split round-robin over ranks (validation and probe sequences)."""

    def __init__(self, count: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, count, world_size))

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)
