"""LayerNorm and RMSNorm written as geometry on the last dimension (Gupta et al., sections 2-3).

LayerNorm's standardization ``(x - mean(x)) / std(x)`` is three steps: (1) remove the component of x
along the uniform vector ``1 = [1, ..., 1]``, (2) normalize what is left to unit length, (3) scale by
sqrt(d). RMSNorm is step 2-3 alone: ``x / rms(x) = sqrt(d) * x / ||x||``. The functions here spell out
those steps, yet equal ``F.layer_norm`` / ``F.rms_norm`` including eps, so the probe can trust them.

Every function works on tensors of any leading shape ``(..., d)``. Half-precision inputs (bf16, fp16)
are computed in float32 and cast back, as PyTorch's own norm kernels do.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Literal, NamedTuple

import torch

NormKind = Literal["layer", "rms"]
# The site kinds whose standardized input (the norm without its affine part) is defined.
STANDARDIZABLE_KINDS: tuple[str, ...] = ("layer", "rms")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: sums of squares in bf16/fp16 lose too many digits to be worth measuring."""
    return torch.promote_types(dtype, torch.float32)


def uniform_vector(
    d: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The uniform vector ``1`` of R^d: the one direction LayerNorm throws away. Its norm is sqrt(d)."""
    return torch.ones(d, dtype=dtype, device=device)


def remove_uniform_component(x: torch.Tensor) -> torch.Tensor:
    """Step 1: project x onto the hyperplane orthogonal to ``1``, i.e. ``x - (x . 1 / d) 1 = x - mean(x)``.

    Shifting x by any multiple of ``1`` leaves this projection unchanged, so we first subtract the first
    component: a constant vector then projects to exactly zero (not to rounding noise that eps=0 would
    blow up to a random direction), and a large mean cancels before it can cost digits.
    """
    shifted = x - x[..., :1]
    return shifted - shifted.mean(dim=-1, keepdim=True)


def _scaled_unit(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Steps 2 and 3: ``sqrt(d) * v / sqrt(||v||^2 + d * eps)``, i.e. ``v / sqrt(mean(v^2) + eps)``.

    With eps=0 this is v normalized to unit length and scaled by sqrt(d); eps softens the length exactly
    as the norms' ``sqrt(var + eps)`` does. A zero v with eps=0 is 0/0 = NaN, as in PyTorch's kernels.
    """
    d = v.shape[-1]
    length = torch.sqrt(v.square().sum(dim=-1, keepdim=True) + d * eps)
    return math.sqrt(d) * (v / length)


def layernorm_three_steps(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm as remove-``1``, normalize, scale by sqrt(d), then ``weight * y + bias``.

    Since ``||x_perp|| = sqrt(d * var(x))``, dividing by ``sqrt(var + eps)`` is the same as
    ``sqrt(d) * x_perp / sqrt(||x_perp||^2 + d * eps)``: this equals ``F.layer_norm(x, (d,), weight,
    bias, eps)``. A constant vector has no direction off ``1``: the result is ``bias`` (zero) when
    eps > 0, and NaN when eps = 0, like ``F.layer_norm``.
    """
    compute = _compute_dtype(x.dtype)
    x_perp = remove_uniform_component(x.to(compute))  # step 1
    y = _scaled_unit(x_perp, eps)  # steps 2 and 3
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def rmsnorm_one_step(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm as a single rescaling ``sqrt(d) * x / sqrt(||x||^2 + d * eps)``, then the gain ``weight``.

    It keeps the direction of x, component along ``1`` included; equals ``F.rms_norm(x, (d,), weight,
    eps)``. A zero vector gives zero when eps > 0 and NaN when eps = 0, like ``F.rms_norm``.
    """
    compute = _compute_dtype(x.dtype)
    y = _scaled_unit(x.to(compute), eps)
    if weight is not None:
        y = y * weight.to(compute)
    return y.to(x.dtype)


def standardize(x: torch.Tensor, kind: NormKind | str, eps: float) -> torch.Tensor:
    """The norm of ``kind`` ("layer" or "rms") without its affine part: the vector right after
    standardization, where the probe measures the angle to ``1`` before weight and bias move it."""
    if kind == "layer":
        return layernorm_three_steps(x, eps=eps)
    if kind == "rms":
        return rmsnorm_one_step(x, eps=eps)
    raise ValueError(f"unknown norm kind {kind!r}: choose one of {', '.join(STANDARDIZABLE_KINDS)}")


# The devices where the probe's statistics may read a size back to the host (on the CPU nothing is queued
# to wait for): they count exactly the entries they need rather than work around the read as on a GPU.
HOST_READ_DEVICES = {"cpu"}


def reads_back(device: torch.device) -> bool:
    """Whether the statistics on ``device`` take the code path that reads sizes back (see
    :data:`HOST_READ_DEVICES`)."""
    return device.type in HOST_READ_DEVICES


@contextlib.contextmanager
def gpu_code_path() -> Iterator[None]:
    """The statistics on the CPU by the GPU's code path (no size read back), so that the CPU profiler counts
    the host syncs a GPU would make (``bench/probe_cost.py``'s ``op_counts`` and the scripts and tests that
    use it). The values are the same either way."""
    saved = set(HOST_READ_DEVICES)
    HOST_READ_DEVICES.clear()
    try:
        yield
    finally:
        HOST_READ_DEVICES.update(saved)


# Where |cos| exceeds this (angles under 60 or over 120 degrees), the sine comes from the explicit
# perpendicular component; below it sqrt(1 - cos^2) loses no digits (error <= 1.2x that of cos).
NEAR_AXIS_COS = 0.5


class UnitReferences(NamedTuple):
    """References made ready for :func:`angle_deg` once (:func:`unit_references`), not at every call."""

    units: torch.Tensor  # (D, d): ref / ||ref||, in the dtype angle_deg computes in
    valid: torch.Tensor  # (D,): ||ref|| > 0 (a zero reference has no direction)
    single: bool  # one reference (d,) was given: angle_deg drops the references' dimension


def unit_references(ref: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> UnitReferences:
    """``ref`` (d,) or (D, d) as :func:`angle_deg` prepares it for inputs of ``dtype`` (the same bits)."""
    refs = ref.to(device=device, dtype=_compute_dtype(dtype))
    single = refs.dim() == 1
    refs = refs.reshape(-1, refs.shape[-1])
    ref_norm = torch.linalg.vector_norm(refs, dim=-1)
    return UnitReferences(refs / ref_norm.unsqueeze(-1), ref_norm > 0, single)


def angle_deg(
    x: torch.Tensor, ref: torch.Tensor | UnitReferences, near_axis_capacity: int | None = None,
    x_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Angle in degrees, in [0, 180], between every vector ``x[..., :]`` and the reference ``ref``.

    ``ref`` is one vector (d,) (result shape ``x.shape[:-1]``) or D of them (D, d) (result shape
    ``x.shape[:-1] + (D,)``), or either made ready by :func:`unit_references` for x's dtype (a caller that
    measures against the same references many times). Computed in float64 for float64 input, else float32
    (bf16/fp16 are cast up). The one angle formula of the package (the statistics engine calls it too):
    ``atan2(sin, cos)`` of the unit vectors a, b, never ``arccos(cos)``, which loses half its digits near 0
    and 180 degrees and is NaN for a rounded cosine above 1. ``cos = x . b / ||x||`` is one matmul; ``sin``
    is ``||a - cos b||`` (the perpendicular component, accurate near 0 and 180) where |cos| >
    ``NEAR_AXIS_COS`` and ``sqrt(1 - cos^2)`` elsewhere. A zero vector (or a zero ``ref``) has no
    direction: its angle is NaN, and callers count such vectors apart.

    The host never waits for the number of near-axis pairs (on a GPU that is a sync per call). With
    ``near_axis_capacity`` None every (vector, reference) pair's perpendicular is computed ((vectors x D x d)
    work, for a few references) and kept where near the axis. Else the near-axis pairs are picked on the
    device into a buffer of that many pairs ((capacity x d) work, for many references); near-axis pairs past
    the first ``near_axis_capacity`` (in row-major order) keep ``sqrt(1 - cos^2)``: about 0.03 deg off right
    at the axis in float32, 1e-5 deg at 10 deg from it. ``x_norm`` (..., 1): the vectors' norms where the
    caller has them already (a pass over the vectors less), in the dtype computed in.
    """
    # Under autocast (the probe runs in the training precision) the matmul would round to bf16/fp16.
    with torch.autocast(x.device.type, enabled=False):
        return _angle_deg(x, ref, near_axis_capacity, x_norm)


def _angle_deg(
    x: torch.Tensor, ref: torch.Tensor | UnitReferences, near_axis_capacity: int | None,
    x_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    compute = _compute_dtype(x.dtype)
    x = x.to(compute)
    refs = ref if isinstance(ref, UnitReferences) else unit_references(ref, compute, x.device)
    if refs.units.dtype != compute:
        raise ValueError(f"references prepared for {refs.units.dtype}, not for {compute} inputs")
    b = refs.units
    if x_norm is None:
        x_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    # (x b) / ||x||, not (x / ||x||) b: no (vectors x d) quotient; the unit vectors only where refined.
    cos = (x @ b.T).div_(x_norm)  # (..., D)
    refs_count = b.shape[0]
    # One spare row past the sines: where the unused slots of a capacity's buffer are written.
    buffer = cos.new_empty(cos.numel() // refs_count + 1, refs_count) if refs_count else cos.new_empty(1, 0)
    sin = torch.sqrt((1.0 - cos.square()).clamp_(min=0.0), out=buffer[:-1].view_as(cos))
    near_axis = cos.abs() > NEAR_AXIS_COS
    if reads_back(x.device):
        # The CPU waits on nothing to count the near-axis pairs: only theirs are computed, not every pair's
        # (a float64 (vectors x D x d) temporary costs more than the rest of the statistics).
        sin = _refine_near_axis(buffer, near_axis, cos, x, x_norm, b, near_axis_capacity)
    elif near_axis_capacity is None:
        # a and cos b broadcast to (..., D, d): each pair's perpendicular by the same operations as alone
        a = (x / x_norm).unsqueeze(-2)
        perpendicular = torch.linalg.vector_norm(a - cos.unsqueeze(-1) * b, dim=-1)
        sin = torch.where(near_axis, perpendicular, sin)
    elif min(cos.numel(), near_axis_capacity) > 0:
        capacity = min(cos.numel(), near_axis_capacity)
        sin = _refine_near_axis(buffer, near_axis, cos, x, x_norm, b, capacity, static=True)
    degrees = torch.rad2deg(torch.atan2(sin, cos))
    valid = (x_norm > 0) & refs.valid  # (..., D)
    degrees = torch.where(valid, degrees, math.nan)
    return degrees.squeeze(-1) if refs.single else degrees


def _refine_near_axis(buffer: torch.Tensor, near_axis: torch.Tensor, cos: torch.Tensor, x: torch.Tensor,
                      x_norm: torch.Tensor, b: torch.Tensor, capacity: int | None, static: bool = False
                      ) -> torch.Tensor:
    """The sines, ``buffer[:-1]``, with ``||a - cos b||`` (``a = x / ||x||``) at the first ``capacity`` pairs
    where ``near_axis`` (None: every one).

    ``static``: ``nonzero_static`` fills a buffer of fixed size with the (vector, reference) pairs, where
    ``nonzero`` and a branch on ``any()`` would each wait on a GPU for their number. Unused slots hold
    (-1, -1): they compute the last pair again and are written to the spare last row of ``buffer``. Else
    (the CPU, where nothing waits) ``nonzero`` gives exactly the near-axis pairs. Either way the pairs come in
    ``nonzero``'s order and each is computed by the same operations as alone, so the values are the same bits.
    """
    refs = b.shape[0]
    cos_pairs = cos.reshape(-1, refs)
    if static:
        picked = torch.nonzero_static(near_axis.reshape(-1, refs), size=capacity, fill_value=-1)
    else:
        picked = torch.nonzero(near_axis.reshape(-1, refs))[:capacity]
    row, col = picked.unbind(1)
    a = x.reshape(-1, x.shape[-1])[row] / x_norm.reshape(-1, 1)[row]
    perpendicular = a - cos_pairs[row, col].unsqueeze(-1) * b[col]
    buffer.index_put_((row, col), torch.linalg.vector_norm(perpendicular, dim=-1))
    return buffer[:-1].view_as(cos)
