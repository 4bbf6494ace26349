"""The geometric norms equal PyTorch's, and have the geometry the paper claims (orthogonal to 1, norm
sqrt(d))."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from normgeo.measure.geometry import (
    angle_deg,
    layernorm_three_steps,
    remove_uniform_component,
    rmsnorm_one_step,
    standardize,
    uniform_vector,
)

# database=None: no .hypothesis/ folder left in the repo; failures print their reproducing example.
FAST = settings(max_examples=60, deadline=None, database=None)

EPSILONS = (0.0, 1e-6, 1e-5, 1e-2)
POSITIVE_EPSILONS = tuple(eps for eps in EPSILONS if eps > 0)
EDGE_DIMS = (1, 2, 3, 4096)
TIGHT = {"rtol": 1e-10, "atol": 1e-10}  # float64: both sides agree to a few ulp


def dims(min_dim: int = 1) -> st.SearchStrategy[int]:
    edges = [d for d in EDGE_DIMS if d >= min_dim]
    return st.one_of(st.sampled_from(edges), st.integers(min_dim, 4096))


@st.composite
def vectors(draw: st.DrawFn, min_dim: int = 1, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Gaussian vectors (..., d) of magnitude 1e-4 .. 1e4, some with a mean far from zero."""
    d = draw(dims(min_dim))
    leading = draw(st.sampled_from([(), (3,), (2, 3)]))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = 10.0 ** draw(st.floats(-4.0, 4.0))
    offset = draw(st.sampled_from([0.0, 0.0, 1.0, -10.0]))  # mean, in units of the spread
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn((*leading, d), generator=gen, dtype=torch.float64)
    return (scale * (z + offset)).to(dtype)


def affine(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = 1.0 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    bias = torch.randn(d, generator=gen, dtype=torch.float64)
    return weight, bias


def numpy_angle_deg(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The textbook float64 angle, independent of the code under test."""
    x = x.astype(np.float64)
    ref = ref.astype(np.float64)
    cos = (x @ ref) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(ref))
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))


def row_angles(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Angle between y[i] and x[i] for every row (angle_deg takes a single reference)."""
    d = x.shape[-1]
    return torch.stack([angle_deg(a, b) for a, b in zip(y.reshape(-1, d), x.reshape(-1, d), strict=True)])


# --- uniform vector and step 1 ---------------------------------------------------------------------


@pytest.mark.parametrize("d", EDGE_DIMS)
def test_uniform_vector_is_ones_of_norm_sqrt_d(d: int) -> None:
    one = uniform_vector(d, dtype=torch.float64, device="cpu")
    assert one.shape == (d,) and one.dtype == torch.float64 and one.device.type == "cpu"
    assert torch.equal(one, torch.ones(d, dtype=torch.float64))
    assert math.isclose(float(one.norm()), math.sqrt(d), rel_tol=1e-15)
    assert uniform_vector(d, dtype=torch.bfloat16).dtype == torch.bfloat16


@FAST
@given(x=vectors())
def test_remove_uniform_component_is_the_projection_off_one(x: torch.Tensor) -> None:
    d = x.shape[-1]
    x_perp = remove_uniform_component(x)
    assert x_perp.shape == x.shape and x_perp.dtype == x.dtype
    # what was removed is a multiple of 1 ...
    removed = x - x_perp
    spread = (removed.amax(-1) - removed.amin(-1)) / x.abs().amax(-1).clamp(min=1e-300)
    assert float(spread.max()) < 1e-12
    # ... and what is left has no component along 1
    one = uniform_vector(d, dtype=x.dtype)
    tol = 1e-12 * math.sqrt(d) * float(x.abs().max())
    assert float((x_perp @ one).abs().max()) <= tol
    # it is the classic mean subtraction, and a projection (idempotent)
    torch.testing.assert_close(
        x_perp, x - x.mean(-1, keepdim=True), rtol=1e-9, atol=1e-12 * float(x.abs().max())
    )
    torch.testing.assert_close(remove_uniform_component(x_perp), x_perp, rtol=1e-9, atol=tol)


def test_remove_uniform_component_of_a_constant_vector_is_exactly_zero() -> None:
    # 0.1 * 1 has a float mean that is not exactly 0.1: plain x - x.mean() leaves rounding noise here.
    x = torch.full((2, 3), 0.1, dtype=torch.float64)
    assert torch.equal(remove_uniform_component(x), torch.zeros_like(x))
    assert torch.equal(remove_uniform_component(torch.tensor([7.5])), torch.zeros(1))


# --- LayerNorm ---------------------------------------------------------------------------------------


@FAST
@given(x=vectors(), eps=st.sampled_from(EPSILONS), with_affine=st.booleans(), seed=st.integers(0, 2**31))
def test_layernorm_three_steps_equals_torch_layer_norm(
    x: torch.Tensor, eps: float, with_affine: bool, seed: int
) -> None:
    d = x.shape[-1]
    weight, bias = affine(d, seed) if with_affine else (None, None)
    ours = layernorm_three_steps(x, weight, bias, eps=eps)
    theirs = F.layer_norm(x, (d,), weight, bias, eps=eps)
    assert ours.shape == x.shape and ours.dtype == x.dtype
    # d=1 with eps=0 is 0/0 on both sides: NaN where torch gives NaN, and nowhere else
    torch.testing.assert_close(ours, theirs, equal_nan=True, **TIGHT)
    if eps > 0 or d > 1:
        assert not bool(ours.isnan().any())


@FAST
@given(x=vectors(), eps=st.sampled_from(EPSILONS), seed=st.integers(0, 2**31))
def test_layernorm_with_only_weight_or_only_bias(x: torch.Tensor, eps: float, seed: int) -> None:
    d = x.shape[-1]
    weight, bias = affine(d, seed)
    for w, b in ((weight, None), (None, bias)):
        torch.testing.assert_close(
            layernorm_three_steps(x, w, b, eps=eps),
            F.layer_norm(x, (d,), w, b, eps=eps),
            equal_nan=True,
            **TIGHT,
        )


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("d", EDGE_DIMS)
def test_layernorm_three_steps_edge_dims(d: int, eps: float) -> None:
    gen = torch.Generator().manual_seed(d)
    x = 3.0 + 2.0 * torch.randn(4, d, generator=gen, dtype=torch.float64)
    weight, bias = affine(d, seed=d)
    torch.testing.assert_close(
        layernorm_three_steps(x, weight, bias, eps),
        F.layer_norm(x, (d,), weight, bias, eps),
        equal_nan=True,
        **TIGHT,
    )


@FAST
@given(
    d=dims(),
    value=st.one_of(st.just(0.0), st.floats(1e-4, 1e4), st.floats(-1e4, -1e-4)),
    eps=st.sampled_from(POSITIVE_EPSILONS),
    seed=st.integers(0, 2**31),
)
def test_layernorm_of_a_constant_vector_is_the_bias(d: int, value: float, eps: float, seed: int) -> None:
    x = torch.full((2, d), value, dtype=torch.float64)
    weight, bias = affine(d, seed)
    ours = layernorm_three_steps(x, weight, bias, eps=eps)
    assert not bool(ours.isnan().any())
    torch.testing.assert_close(ours, bias.expand_as(x), rtol=0.0, atol=1e-12)
    torch.testing.assert_close(ours, F.layer_norm(x, (d,), weight, bias, eps=eps), rtol=0.0, atol=1e-12)
    assert torch.equal(layernorm_three_steps(x, eps=eps), torch.zeros_like(x))


def test_layernorm_of_a_constant_vector_without_eps_is_nan_like_torch() -> None:
    # documented: with eps=0 a constant vector has no direction off 1 to normalize (0/0)
    x = torch.full((3,), 0.1, dtype=torch.float64)
    assert bool(F.layer_norm(x, (3,), eps=0.0).isnan().all())
    assert bool(layernorm_three_steps(x, eps=0.0).isnan().all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_layernorm_three_steps_half_precision_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (5.0 + 3.0 * torch.randn(8, 768, generator=gen)).to(dtype)
    weight, bias = (t.to(dtype) for t in affine(768, seed=1))
    ours = layernorm_three_steps(x, weight, bias, eps=1e-5)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, F.layer_norm(x, (768,), weight, bias, eps=1e-5))


@FAST
@given(x=vectors(min_dim=2), eps=st.sampled_from(EPSILONS))
def test_layernorm_standardization_is_orthogonal_to_one_with_norm_sqrt_d(x: torch.Tensor, eps: float) -> None:
    d = x.shape[-1]
    y = standardize(x, "layer", eps)
    angles = angle_deg(y, uniform_vector(d, dtype=x.dtype))
    torch.testing.assert_close(angles, torch.full_like(angles, 90.0), rtol=0.0, atol=1e-6)
    # ||y|| = sqrt(d) * ||x_perp|| / sqrt(||x_perp||^2 + d eps) = sqrt(d) * sqrt(var / (var + eps))
    var = np.var(x.numpy(), axis=-1)
    expected = math.sqrt(d) * np.sqrt(var / (var + eps))
    np.testing.assert_allclose(y.norm(dim=-1).numpy(), expected, rtol=1e-12)
    if eps == 0:
        np.testing.assert_allclose(y.norm(dim=-1).numpy(), math.sqrt(d), rtol=1e-12)
    else:
        assert bool((y.norm(dim=-1) < math.sqrt(d)).all())


# --- RMSNorm -----------------------------------------------------------------------------------------


@FAST
@given(x=vectors(), eps=st.sampled_from(EPSILONS), with_weight=st.booleans(), seed=st.integers(0, 2**31))
def test_rmsnorm_one_step_equals_torch_rms_norm(
    x: torch.Tensor, eps: float, with_weight: bool, seed: int
) -> None:
    d = x.shape[-1]
    weight = affine(d, seed)[0] if with_weight else None
    ours = rmsnorm_one_step(x, weight, eps=eps)
    assert ours.shape == x.shape and ours.dtype == x.dtype
    assert not bool(ours.isnan().any())
    torch.testing.assert_close(ours, F.rms_norm(x, (d,), weight, eps=eps), **TIGHT)


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("d", EDGE_DIMS)
def test_rmsnorm_one_step_edge_dims(d: int, eps: float) -> None:
    gen = torch.Generator().manual_seed(d)
    x = 3.0 + 2.0 * torch.randn(4, d, generator=gen, dtype=torch.float64)
    weight = affine(d, seed=d)[0]
    torch.testing.assert_close(rmsnorm_one_step(x, weight, eps), F.rms_norm(x, (d,), weight, eps), **TIGHT)


@pytest.mark.parametrize("eps", POSITIVE_EPSILONS)
@pytest.mark.parametrize("d", EDGE_DIMS)
def test_rmsnorm_of_zero_is_zero_when_eps_positive(d: int, eps: float) -> None:
    x = torch.zeros(2, d, dtype=torch.float64)
    ours = rmsnorm_one_step(x, affine(d, seed=0)[0], eps)
    assert torch.equal(ours, torch.zeros_like(x))
    torch.testing.assert_close(ours, F.rms_norm(x, (d,), affine(d, seed=0)[0], eps), rtol=0.0, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rmsnorm_one_step_half_precision_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (5.0 + 3.0 * torch.randn(8, 768, generator=gen)).to(dtype)
    weight = affine(768, seed=1)[0].to(dtype)
    ours = rmsnorm_one_step(x, weight, eps=1e-5)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, F.rms_norm(x, (768,), weight, eps=1e-5))


@FAST
@given(x=vectors(), eps=st.sampled_from(EPSILONS))
def test_rmsnorm_keeps_direction_with_norm_sqrt_d(x: torch.Tensor, eps: float) -> None:
    d = x.shape[-1]
    y = standardize(x, "rms", eps)
    angles = row_angles(y, x)
    torch.testing.assert_close(angles, torch.zeros_like(angles), rtol=0.0, atol=1e-6)
    # ||y|| = sqrt(d) * ||x|| / sqrt(||x||^2 + d eps) = sqrt(d) * sqrt(ms / (ms + eps))
    ms = np.mean(x.numpy() ** 2, axis=-1)
    expected = math.sqrt(d) * np.sqrt(ms / (ms + eps))
    np.testing.assert_allclose(y.norm(dim=-1).numpy(), expected, rtol=1e-12)
    if eps == 0:
        np.testing.assert_allclose(y.norm(dim=-1).numpy(), math.sqrt(d), rtol=1e-12)


def test_rmsnorm_keeps_the_component_along_one_that_layernorm_removes() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 10.0], dtype=torch.float64)
    one = uniform_vector(4, dtype=torch.float64)
    assert float(angle_deg(standardize(x, "rms", 0.0), one)) == pytest.approx(
        float(angle_deg(x, one)), abs=1e-9
    )
    assert float(angle_deg(x, one)) < 60.0
    assert float(angle_deg(standardize(x, "layer", 0.0), one)) == pytest.approx(90.0, abs=1e-9)


# --- standardize ---------------------------------------------------------------------------------------


@FAST
@given(x=vectors(), eps=st.sampled_from(EPSILONS))
def test_standardize_is_the_norm_without_affine(x: torch.Tensor, eps: float) -> None:
    d = x.shape[-1]
    torch.testing.assert_close(
        standardize(x, "layer", eps), F.layer_norm(x, (d,), eps=eps), equal_nan=True, **TIGHT
    )
    torch.testing.assert_close(standardize(x, "rms", eps), F.rms_norm(x, (d,), eps=eps), **TIGHT)


def test_standardize_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown norm kind"):
        standardize(torch.ones(4), "batch", 1e-5)


# --- angle_deg -------------------------------------------------------------------------------------------


@FAST
@given(x=vectors(), mix=st.floats(-1.0, 1.0), seed=st.integers(0, 2**31))
def test_angle_deg_agrees_with_numpy_float64(x: torch.Tensor, mix: float, seed: int) -> None:
    d = x.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    ref = 3.0 * torch.randn(d, generator=gen, dtype=torch.float64)
    # blend toward +-ref so that all angles in [0, 180] are visited, not only ~90 degrees
    x = mix * ref * float(x.abs().mean()) + (1.0 - abs(mix)) * x
    ours = angle_deg(x, ref)
    assert ours.shape == x.shape[:-1] and ours.dtype == torch.float64
    assert not bool(ours.isnan().any())
    expected = numpy_angle_deg(x.numpy(), ref.numpy())
    # 1e-5 deg: numpy's arccos itself is only good to ~1e-6 deg near 0 and 180
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0.0, atol=1e-5)
    assert bool(((ours >= 0) & (ours <= 180)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_angle_deg_of_low_precision_input_is_computed_in_float32(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(768, generator=gen, dtype=torch.float64)
    x = (torch.randn(16, 768, generator=gen) + 0.3 * ref.float() * torch.linspace(-3, 3, 16)[:, None]).to(
        dtype
    )
    ours = angle_deg(x, ref)
    assert ours.dtype == torch.float32
    # the reference is the exact angle of the very same (rounded) input values
    expected = numpy_angle_deg(x.float().numpy(), ref.numpy())
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0.0, atol=2e-3)
    assert float(expected.max() - expected.min()) > 60.0  # a real spread of angles was tested


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", EDGE_DIMS)
def test_angle_deg_parallel_antiparallel_orthogonal(d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(d)
    ref = torch.randn(d, generator=gen, dtype=torch.float64).to(dtype)
    # powers of two: the scaled copies are exact in bf16 too, so truly parallel
    scales = torch.tensor([2.0**-12, 0.5, 1.0, 4.0, 2.0**12], dtype=torch.float64)
    parallel = (scales[:, None] * ref.double()).to(dtype)
    tol = 1e-6 if dtype == torch.float64 else 1e-3
    torch.testing.assert_close(
        angle_deg(parallel, ref).double(), torch.zeros(5, dtype=torch.float64), rtol=0, atol=tol
    )
    torch.testing.assert_close(
        angle_deg(-parallel, ref).double(), torch.full((5,), 180.0, dtype=torch.float64), rtol=0, atol=tol
    )
    if d >= 2:
        one = uniform_vector(d, dtype=torch.float64)
        ortho = torch.zeros(d, dtype=torch.float64)
        ortho[0], ortho[1] = 1.0, -1.0  # orthogonal to 1
        assert float(angle_deg(ortho.to(dtype), one)) == pytest.approx(90.0, abs=1e-9)


def test_angle_deg_of_zero_vectors_is_nan_and_only_there() -> None:
    ref = torch.tensor([1.0, 2.0, 3.0])
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [-2.0, -4.0, -6.0], [3.0, 0.0, -1.0]])
    angles = angle_deg(x, ref)
    assert bool(angles[0].isnan())
    assert not bool(angles[1:].isnan().any())
    assert float(angles[1]) == pytest.approx(0.0, abs=1e-3)
    assert float(angles[2]) == pytest.approx(180.0, abs=1e-3)
    assert float(angles[3]) == pytest.approx(90.0, abs=1e-3)
    assert bool(angle_deg(x, torch.zeros(3)).isnan().all())


def test_angle_deg_never_nan_for_nonzero_near_parallel_float32() -> None:
    # arccos of a rounded cosine slightly above 1 is NaN; the angle must stay a number here
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(200, 512, generator=gen)
    for r in ref:
        angles = angle_deg(torch.stack([r * 1.0000001, r * 7.3, -r * 0.1]), r)
        assert not bool(angles.isnan().any())
        assert float(angles[:2].max()) < 1e-2 and float(angles[2]) > 180.0 - 1e-2
