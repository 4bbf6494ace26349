"""The streaming statistics engine against exact computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normgeo.measure.geometry import angle_deg, rmsnorm_one_step
from normgeo.measure.stats import (
    NULL_QUANTILES,
    QUANTILES,
    AngleStatistics,
    block_bootstrap,
    difference_power,
    null_comparison,
    seeds_for_difference,
    seeds_for_equivalence,
    smallest_decidable_margin,
    tost_power,
)


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
        "bimodal": torch.cat(
            [torch.randn(13_000, d, generator=g) + ones, torch.randn(17_000, d, generator=g) - ones]
        ),
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


# Null directions, per-sequence sums, where 1 stands, block bootstrap


def test_null_directions_moments_and_per_sequence_sums_are_exact_and_merge() -> None:
    d, k, sequences, length = 24, 5, 6, 50
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sequences, length, d, generator=g) + 0.3
    x[2, 7] = 0  # a zero vector: counted apart, in no per-sequence sum
    refs = torch.stack([torch.ones(d), torch.randn(d, generator=g)])
    null = torch.randn(k, d, generator=g) * 4  # not unit: the engine normalizes
    whole = AngleStatistics(1, refs, null_directions=null, num_sequences=sequences)
    whole.update(0, x, torch.arange(sequences))
    halves = [AngleStatistics(1, refs, null_directions=null, num_sequences=sequences) for _ in range(2)]
    halves[0].update(0, x[[4, 0, 2]], torch.tensor([4, 0, 2]))  # any order, any split
    halves[1].update(0, x[[1, 5]], torch.tensor([1, 5]))
    halves[1].update(0, x[[3]], torch.tensor([3]))
    halves[0].merge(halves[1])
    flat = x.reshape(-1, d)
    kept = flat.norm(dim=1) > 0
    exact_null = exact_angles(flat[kept], null)  # (n, K)
    for stats in (whole, halves[0]):
        assert stats.null_count[0].eq(kept.sum()).all() and stats.zero_count[0] == 1
        np.testing.assert_allclose(stats.null_mean[0].numpy(), exact_null.mean(0), atol=1e-4)
        np.testing.assert_allclose(stats.null_std()[0].numpy(), exact_null.std(0), atol=1e-4)
        every = exact_angles(flat, torch.cat([refs, null]))  # zero row gives nan, dropped below
        per_seq = every.reshape(sequences, length, -1)
        mask = kept.reshape(sequences, length).numpy()
        np.testing.assert_array_equal(stats.seq_count[0].numpy(), mask.sum(1))
        expected_sum = np.where(mask[..., None], per_seq - 90, 0).sum(1)
        np.testing.assert_allclose(stats.seq_sum[0].numpy(), expected_sum, atol=1e-3)
        expected_sq = np.where(mask[..., None], (per_seq[..., :2] - 90) ** 2, 0).sum(1)
        np.testing.assert_allclose(stats.seq_sumsq[0].numpy(), expected_sq, rtol=1e-5)
    # The references' statistics are what they were without null directions.
    plain = AngleStatistics(1, refs)
    plain.update(0, x)
    assert torch.equal(plain.hist, whole.hist) and torch.allclose(plain.mean, whole.mean, atol=1e-10)


def test_sites_in_one_pass_equal_sites_one_by_one() -> None:
    """The GPU's one pass over a norm's consecutive sites (forced here on the CPU) gives each site what
    its own update gives: moments, extremes, histograms, zero vectors, null directions, per-sequence sums;
    a site of zero vectors only adds nothing."""
    d, sites, sequences, length = 32, 3, 4, 40
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sites, sequences, length, d, generator=g) + 0.2
    x[0, 1, 3] = 0  # one zero vector at the first site
    x[2] = 0  # a site of zero vectors only
    refs = torch.stack([torch.ones(d), torch.randn(d, generator=g)])
    null = torch.randn(6, d, generator=g)

    def statistics(per_pass: int) -> AngleStatistics:
        return AngleStatistics(
            sites + 1, refs, null_directions=null, num_sequences=sequences, sites_per_pass=per_pass
        )

    one_pass, one_by_one = statistics(sites), statistics(1)
    for stats in (one_pass, one_by_one):
        stats.update_sites(1, list(x[:, :2]), torch.tensor([2, 0]))  # sites 1 to 3; site 0 is left alone
        stats.update_sites(1, list(x[:, 2:]), torch.tensor([1, 3]))
    assert one_pass.zero_count.tolist() == [0, 1, 0, sequences * length]
    assert one_pass.count[3].eq(0).all() and one_pass.count[1].eq(sequences * length - 1).all()
    for field in (
        "count",
        "mean",
        "m2",
        "min",
        "max",
        "hist",
        "zero_count",
        "norm_count",
        "norm_mean",
        "norm_m2",
        "null_count",
        "null_mean",
        "null_m2",
        "seq_count",
        "seq_sum",
        "seq_sumsq",
    ):
        torch.testing.assert_close(
            getattr(one_pass, field), getattr(one_by_one, field), rtol=1e-12, atol=1e-9, msg=field
        )


def test_where_ones_stands_follows_its_definitions() -> None:
    d = 64
    g = torch.Generator().manual_seed(4)
    # Site 0: vectors with a component along 1 (1 is atypical); site 1: isotropic (1 is typical).
    tilted = torch.randn(4000, d, generator=g) + 0.4
    isotropic = torch.randn(4000, d, generator=g)
    null = torch.randn(40, d, generator=g)
    stats = AngleStatistics(2, torch.ones(1, d), null_directions=null)
    stats.update(0, tilted)
    stats.update(1, isotropic)
    where = null_comparison(stats)
    for s, x in enumerate((tilted, isotropic)):
        ones = exact_angles(x, torch.ones(1, d))[:, 0]
        nulls = exact_angles(x, null)
        for name, value, null_values in (
            ("mean", ones.mean(), nulls.mean(0)),
            ("std", ones.std(), nulls.std(0)),
        ):
            assert where[name][s].item() == pytest.approx(value, abs=1e-4)
            np.testing.assert_allclose(where[f"{name}_null_q"][s].numpy(),
                                       np.quantile(null_values, NULL_QUANTILES), atol=1e-4)
            expected_rank = 100 * (null_values < value).mean()
            assert where[f"{name}_rank"][s].item() == pytest.approx(expected_rank)
            expected_z = (value - null_values.mean()) / null_values.std(ddof=1)
            assert where[f"{name}_z"][s].item() == pytest.approx(expected_z, rel=1e-4)
    assert where["mean_rank"][0] == 0 and where["mean_z"][0] < -5  # 1 is far below every random direction
    assert 5 < where["mean_rank"][1] < 95


def synthetic_sequences(rng: np.random.Generator, datasets: int, sequences: int, length: int) -> tuple:
    """Angles whose true mean is 90 exactly, correlated within a sequence like tokens of one document.

    Each sequence has its own offset (sd 2 deg) and AR(1) noise (phi 0.9, sd 3 deg); its length varies.
    Returns per-sequence (count, sum of angle - 90) and the token-level mean and std per data set.
    """
    offset = rng.normal(0, 2, (datasets, sequences, 1))
    noise = np.empty((datasets, sequences, length))
    noise[..., 0] = rng.normal(0, 3, (datasets, sequences))
    innovations = rng.normal(0, 3 * np.sqrt(1 - 0.9**2), (datasets, sequences, length))
    for t in range(1, length):
        noise[..., t] = 0.9 * noise[..., t - 1] + innovations[..., t]
    centered = offset + noise
    counts = rng.integers(length // 2, length + 1, (datasets, sequences))
    mask = np.arange(length) < counts[..., None]
    sums = np.where(mask, centered, 0).sum(-1)
    n = counts.sum(-1)
    token_mean = sums.sum(-1) / n
    token_std = np.sqrt(np.where(mask, (centered - token_mean[:, None, None]) ** 2, 0).sum((-2, -1)) / n)
    return counts.astype(np.float64), sums, token_mean, token_std, n


def test_block_bootstrap_interval_covers_the_true_mean_at_the_stated_rate() -> None:
    datasets, sequences, length = 400, 60, 48
    counts, sums, token_mean, token_std, n = synthetic_sequences(
        np.random.default_rng(0), datasets, sequences, length
    )
    # All data sets at once: each is one "site" of the engine's per-sequence arrays.
    interval = block_bootstrap(counts, sums[..., None], replicates=1000, seed=1)
    np.testing.assert_allclose(interval["mean"], 90 + token_mean)
    coverage = np.mean((interval["mean_low"] <= 90) & (interval["mean_high"] >= 90))
    assert 0.92 <= coverage <= 0.975, coverage
    # The token-level interval (tokens as independent draws) is far too narrow: the test can fail.
    naive = 1.96 * token_std / np.sqrt(n)
    assert np.mean(np.abs(token_mean) <= naive) < 0.5


def test_block_bootstrap_blocks_and_seed() -> None:
    rng = np.random.default_rng(5)
    counts = rng.integers(10, 20, (3, 11)).astype(np.float64)
    sums = rng.normal(0, 30, (3, 11, 4))
    first = block_bootstrap(counts, sums, null=slice(1, 4), replicates=300, block=3, seed=7)
    again = block_bootstrap(counts, sums, null=slice(1, 4), replicates=300, block=3, seed=7)
    other = block_bootstrap(counts, sums, null=slice(1, 4), replicates=300, block=3, seed=8)
    assert all(np.array_equal(first[key], again[key]) for key in first)
    assert not np.array_equal(first["mean_low"], other["mean_low"])
    null_means = 90 + sums[:, :, 1:].sum(1) / counts.sum(1, keepdims=True)
    np.testing.assert_allclose(first["diff"], first["mean"] - np.median(null_means, axis=1))
    assert np.all(first["diff_low"] <= first["diff_high"]) and np.all(first["mean_low"] < first["mean_high"])
    # One block holding every sequence: every replicate is the sample itself.
    whole = block_bootstrap(counts, sums, replicates=50, block=11, seed=0)
    np.testing.assert_allclose(whole["mean_low"], whole["mean"])
    np.testing.assert_allclose(whole["mean_high"], whole["mean"])


@pytest.mark.parametrize("target_deg", [1e-3, 0.05, 89.999, 90.0, 179.95, 180.0 - 1e-3])
def test_engine_angles_are_accurate_near_0_90_and_180_degrees(target_deg: float) -> None:
    # arccos of a float32 cosine reads 1e-3 deg as 0 (cos rounds to 1); the engine's atan2 must not.
    d = 64
    theta = np.radians(target_deg)
    ref = torch.zeros(d)
    ref[0] = 1.0
    x = torch.zeros(5, d)
    x[:, 0] = float(np.cos(theta))
    x[:, 1] = float(np.sin(theta))
    x *= torch.tensor([0.5, 1.0, 3.0, 100.0, 1e4])[:, None]  # the length must not matter
    stats = AngleStatistics(1, torch.stack([ref, torch.ones(d)]))
    stats.update(0, x)
    exact = exact_angles(x, ref[None])[:, 0]  # float64 from the float32 inputs actually given
    np.testing.assert_allclose(exact, target_deg, atol=1e-5)
    assert stats.mean[0, 0].item() == pytest.approx(target_deg, abs=2e-5)
    assert stats.min[0, 0].item() == pytest.approx(target_deg, abs=2e-5)
    assert stats.max[0, 0].item() == pytest.approx(target_deg, abs=2e-5)
    np.testing.assert_allclose(angle_deg(x, ref).numpy(), target_deg, atol=2e-5)


@pytest.mark.parametrize(("sd", "margin"), [(0.017, 0.02), (0.5, 0.02), (2.0, 0.02)])
def test_seeds_for_difference_is_the_fewest_with_the_power(sd: float, margin: float) -> None:
    """Also where statsmodels' root finder gives up on a small effect (it returns nan): the search finds
    it."""
    n = seeds_for_difference(sd, margin)
    assert difference_power(n, sd, margin) >= 0.8 > difference_power(n - 1, sd, margin)


def test_more_seeds_than_the_planners_search_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="more than 100000 seeds"):
        seeds_for_difference(1000.0, 0.001)


@pytest.mark.parametrize(("n", "sd"), [(7, 0.022), (13, 0.022), (5, 0.08), (30, 0.002)])
def test_the_smallest_decidable_margin_inverts_the_seeds_a_margin_needs(n: int, sd: float) -> None:
    """The CPU study's page states the margin its seeds reach: at it TOST has 80% power with n seeds, and n
    seeds are exactly enough for it (a hair narrower needs more)."""
    margin = smallest_decidable_margin(n, sd)
    assert tost_power(n, sd, margin) == pytest.approx(0.8, abs=1e-6)
    assert seeds_for_equivalence(sd, margin * 1.001) <= n < seeds_for_equivalence(sd, margin * 0.99)
    with pytest.raises(ValueError, match="at least 2 seeds"):
        smallest_decidable_margin(1, sd)


def test_an_rms_standardized_site_from_its_inputs_norms_equals_the_standardized_vectors_measured() -> None:
    """The RMSNorm-standardized input is never made: its angles are the input's and its norms come from the
    input's. Against the standardized vectors measured as a site of their own, with vectors so short that eps
    moves the norm by a third (a dropped or misplaced eps fails)."""
    generator = torch.Generator().manual_seed(6)
    references = torch.randn(3, 16, dtype=torch.float64, generator=generator)
    nulls = torch.randn(8, 16, dtype=torch.float64, generator=generator)
    x = 0.002 * torch.randn(2, 23, 16, generator=generator)
    y = torch.randn(2, 23, 16, generator=generator)
    eps = 2e-6
    derived = AngleStatistics(3, references, null_directions=nulls, num_sequences=2)
    derived.update_sites(0, [x, y], torch.arange(2), rms_standardized=(1, eps))
    made = AngleStatistics(3, references, null_directions=nulls, num_sequences=2)
    made.update_sites(0, [x, rmsnorm_one_step(x, eps=eps), y], torch.arange(2))
    assert not torch.allclose(made.norm_mean[1], torch.tensor(4.0, dtype=torch.float64), rtol=0.1)
    for field in ("norm_mean", "norm_m2", "mean", "m2", "min", "max", "null_mean", "null_m2", "seq_sum"):
        torch.testing.assert_close(getattr(derived, field), getattr(made, field), rtol=1e-5, atol=1e-6)
    assert torch.equal(derived.hist, made.hist)
