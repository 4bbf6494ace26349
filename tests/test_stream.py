"""The batch stream is a pure function of (data, seed, global step), whatever the device count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corpus.stream import ShardSampler, StepSampler, TokenWindows, window_offsets


@pytest.fixture
def windows(tmp_path) -> TokenWindows:
    tokens = np.random.default_rng(0).integers(0, 50257, size=20_000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    return TokenWindows(str(path), len(tokens), seq_len=32, global_batch=16, seed=7)


def global_batches(windows: TokenWindows, world: int, micro: int, steps: range) -> list[torch.Tensor]:
    """Reassemble each step's global batch from every rank's micro-batches, in stream order."""
    per_rank = []
    for rank in range(world):
        sampler = StepSampler(global_batch=16, micro_batch=micro, rank=rank, world_size=world,
                              max_steps=steps.stop, start_step=lambda: steps.start)
        per_rank.append([windows[i][0] for i in sampler])
    accumulation = 16 // (world * micro)
    batches = []
    for step_index in range(len(steps)):
        rows = []
        for micro_step in range(accumulation):
            for rank in range(world):
                start = (step_index * accumulation + micro_step) * micro
                rows += per_rank[rank][start : start + micro]
        batches.append(torch.stack(rows))
    return batches


@pytest.mark.parametrize(("world", "micro"), [(2, 8), (2, 1), (4, 2), (8, 2), (16, 1)])
def test_any_device_count_sees_the_same_global_batches(windows: TokenWindows, world: int, micro: int) -> None:
    single = global_batches(windows, 1, 16, range(0, 5))
    multi = global_batches(windows, world, micro, range(0, 5))
    for a, b in zip(single, multi, strict=True):
        assert torch.equal(a, b)


def test_resuming_at_a_step_continues_the_same_stream(windows: TokenWindows) -> None:
    whole = global_batches(windows, 1, 4, range(0, 6))
    resumed = global_batches(windows, 2, 2, range(3, 6))
    for a, b in zip(whole[3:], resumed, strict=True):
        assert torch.equal(a, b)


def test_stream_depends_on_seed_and_step_only(windows: TokenWindows) -> None:
    assert np.array_equal(window_offsets(7, 3, 16, 20_000, 33), window_offsets(7, 3, 16, 20_000, 33))
    assert not np.array_equal(window_offsets(7, 3, 16, 20_000, 33), window_offsets(7, 4, 16, 20_000, 33))
    assert not np.array_equal(window_offsets(7, 3, 16, 20_000, 33), window_offsets(8, 3, 16, 20_000, 33))


def test_targets_are_inputs_shifted_by_one(windows: TokenWindows) -> None:
    inputs, targets = windows[5]
    assert inputs.dtype == torch.int64 and inputs.shape == (32,)
    assert torch.equal(inputs[1:], targets[:-1])


def test_indivisible_global_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        StepSampler(global_batch=16, micro_batch=3, rank=0, world_size=2, max_steps=1, start_step=lambda: 0)


def test_shards_are_disjoint_and_cover_everything() -> None:
    shards = [list(ShardSampler(10, rank, 3)) for rank in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
