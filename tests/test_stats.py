"""The streaming statistics engine against exact computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normgeo.geometry import angle_deg
from normgeo.stats import QUANTILES, AngleStatistics


def exact_angles(x: torch.Tensor, refs: torch.Tensor) -> np.ndarray:
    """Reference angles in float64, straight from the definition."""
    x64, r64 = x.double(), refs.double()
    cos = (x64 @ r64.T) / (x64.norm(dim=1, keepdim=True) * r64.norm(dim=1))
    return np.degrees(np.arccos(np.clip(cos.numpy(), -1, 1)))


def distributions(d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(d)
    return {
        "isotropic": torch.randn(30_000, d, generator=g),
        "narrow near 90": torch.randn(30_000, d, generator=g) * 0.01 + torch.randn(d, generator=g),
        "shifted along 1": torch.randn(30_000, d, generator=g) + 0.5 * ones,
        "bimodal": torch.cat([torch.randn(13_000, d, generator=g) + ones, torch.randn(17_000, d, generator=g) - ones]),
    }


@pytest.mark.parametrize("name", ["isotropic", "narrow near 90", "shifted along 1", "bimodal"])
def test_moments_extremes_and_quantiles_match_exact_values(name: str) -> None:
    d = 48
    x = distributions(d)[name]
    refs = torch.stack([torch.ones(d), torch.randn(d, generator=torch.Generator().manual_seed(1))])
    stats = AngleStatistics(1, refs)
    for chunk in x.split(7_777):  # uneven batches exercise the Chan merge
        stats.update(0, chunk)
    exact = exact_angles(x, refs)
    assert torch.equal(stats.count[0], torch.full((2,), float(len(x)), dtype=torch.float64))
    np.testing.assert_allclose(stats.mean[0].numpy(), exact.mean(0), atol=1e-4)
    np.testing.assert_allclose(stats.std()[0].numpy(), exact.std(0), atol=1e-4)
    np.testing.assert_allclose(stats.min[0].numpy(), exact.min(0), atol=1e-3)
    np.testing.assert_allclose(stats.max[0].numpy(), exact.max(0), atol=1e-3)
    quantiles = stats.quantiles()[0].numpy()  # (refs, Q)
    exact_q = np.quantile(exact, QUANTILES, axis=0).T
    assert np.abs(quantiles - exact_q).max() < 0.05


def test_norm_moments_and_zero_vectors_counted_apart() -> None:
    d = 16
    x = torch.randn(1000, d)
    x[::10] = 0
    stats = AngleStatistics(1, torch.ones(1, d))
    stats.update(0, x)
    assert stats.zero_count[0] == 100 and stats.count[0, 0] == 900
    assert not torch.isnan(stats.mean).any() and not torch.isnan(stats.quantiles()).any()
    norms = x.double().norm(dim=1)
    assert stats.norm_mean[0].item() == pytest.approx(norms.mean().item(), rel=1e-6)
    assert stats.norm_std()[0].item() == pytest.approx(norms.std(unbiased=False).item(), rel=1e-6)


def test_merge_equals_one_pass_and_memory_is_flat() -> None:
    d = 32
    x = torch.randn(5000, d) + 0.2
    refs = torch.stack([torch.ones(d), torch.randn(d)])
    whole, left, right = (AngleStatistics(2, refs) for _ in range(3))
    whole.update(1, x)
    left.update(1, x[:1234])
    right.update(1, x[1234:])
    left.merge(right)
    assert torch.equal(left.hist, whole.hist) and torch.equal(left.count, whole.count)
    assert torch.allclose(left.mean, whole.mean, atol=1e-10) and torch.allclose(left.m2, whole.m2, rtol=1e-9)
    assert torch.equal(left.min, whole.min) and torch.equal(left.max, whole.max)
    held = [t.numel() for t in vars(whole).values() if isinstance(t, torch.Tensor)]
    for _ in range(20):
        whole.update(0, torch.randn(2000, d))
    assert [t.numel() for t in vars(whole).values() if isinstance(t, torch.Tensor)] == held


def test_bf16_inputs_are_measured_in_float32() -> None:
    d = 64
    x = torch.randn(2000, d).to(torch.bfloat16)
    stats = AngleStatistics(1, torch.ones(1, d))
    stats.update(0, x)
    expected = angle_deg(x.float(), torch.ones(d)).double()
    assert stats.mean[0, 0].item() == pytest.approx(expected.mean().item(), abs=1e-4)
