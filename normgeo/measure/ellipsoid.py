"""Where a norm's outputs can lie, from its gain and bias alone (Riechers 2024, seed 003).

With eps -> 0 a LayerNorm maps x to  y = G z + b,  z = sqrt(N) P x / ||P x||,  P = I - 1 1^T / N  the
projector onto the hyperplane perpendicular to 1 and G = diag(gain): z runs over the (N-1)-sphere of
radius sqrt(N) in that hyperplane, so y - b runs over an (N-1)-dimensional hyperellipsoid in the
hyperplane G 1^perp, whose normal is G^-1 1 (= 1 / gain). Its principal semi-axes are sqrt(N) times the
singular values of G restricted to 1^perp: sqrt(N) sqrt(lambda) over the nonzero eigenvalues lambda of
P G^2 P (Riechers states the same axes through P G^-2 P and its Drazin inverse). An RMSNorm does not
project: y - b runs over the N-dimensional ellipsoid G sqrt(N) S^{N-1}, semi-axes sqrt(N) |gain_i|.

``ellipsoid_rows`` turns the norms of a model into one record per norm for ``ellipsoid.jsonl``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from normgeo.measure.geometry import STANDARDIZABLE_KINDS
from normgeo.measure.measurement import Measurement, RecordKeys
from normgeo.measure.norm_sites import NormSite
from normgeo.measure.stats import json_number, one_cpu_thread
from normgeo.run_folder import ELLIPSOID_FILE

ELLIPSOID_FIELDS = (
    "model", "norm", "step", "tokens_seen", "layer", "site", "kind", "dim", "axes_dim",
    "semi_axis_max", "semi_axis_min", "condition", "normal_ones_deg", "bias_ones_deg", "bias_norm",
)


def _centered_gram(gain: torch.Tensor) -> torch.Tensor:
    """P G^2 P - 1 1^T / N: its eigenvalue along 1 is -1, below all others (>= 0), so it sorts first.

    With P = I - 1 1^T / N and g = G^2 1, (P G^2 P)_ij = g_i [i = j] - (g_i + g_j) / N + sum(g) / N^2: built
    entry by entry in O(N^2), where the two dense products cost 4 N^3 (about a second at N = 2048, per norm
    and probe; the eigenvalues that follow still cost more)."""
    n = gain.numel()
    squared = gain.square()
    return (torch.diag(squared) - (squared.unsqueeze(0) + squared.unsqueeze(1)) / n
            + (squared.sum() / n**2 - 1.0 / n))


def semi_axes(gain: torch.Tensor, centered: bool) -> torch.Tensor:
    """Principal semi-axis lengths, ascending: N - 1 of them if ``centered`` (LayerNorm), else N."""
    gain = gain.detach().to(torch.float64).reshape(-1)
    root_n = math.sqrt(gain.numel())
    if not centered:
        return root_n * gain.abs().sort().values
    eigenvalues = torch.linalg.eigvalsh(_centered_gram(gain))[1:]  # drop the -1 of the direction 1
    return root_n * eigenvalues.clamp(min=0).sqrt()


def principal_axes(gain: torch.Tensor, centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Semi-axis lengths (ascending) and unit axis directions (columns, in R^N) of the output ellipsoid."""
    gain = gain.detach().to(torch.float64).reshape(-1)
    n = gain.numel()
    if not centered:
        order = gain.abs().argsort()
        return math.sqrt(n) * gain.abs()[order], torch.eye(n, dtype=torch.float64)[:, order]
    eigenvalues, vectors = torch.linalg.eigh(_centered_gram(gain))
    sigma = eigenvalues[1:].clamp(min=0).sqrt()
    # An axis of the image G(1^perp) is G v / sigma for an eigenvector v of P G^2 P in 1^perp.
    directions = gain.unsqueeze(1) * vectors[:, 1:] / sigma.clamp(min=1e-300)
    return math.sqrt(n) * sigma, directions


def angle_with_ones_deg(vector: torch.Tensor) -> float | None:
    """Angle in degrees between ``vector`` and 1 (None for a zero or non-finite vector)."""
    vector = vector.detach().to(torch.float64).reshape(-1)
    norm = vector.norm()
    if not torch.isfinite(norm) or norm == 0:
        return None
    cos = vector.sum() / (norm * math.sqrt(vector.numel()))
    return math.degrees(math.acos(max(-1.0, min(1.0, float(cos)))))


def norm_geometry(gain: torch.Tensor, bias: torch.Tensor | None, centered: bool) -> dict:
    """The record of one norm: extreme semi-axes, condition number, normal's and bias's angles with 1."""
    axes = semi_axes(gain, centered)
    largest, smallest = float(axes[-1]), float(axes[0])
    gain64 = gain.detach().to(torch.float64).reshape(-1)
    # The hyperplane after the gain, G 1^perp, has normal G^-1 1; undefined if a gain is exactly 0.
    normal = None if not centered or bool((gain64 == 0).any()) else angle_with_ones_deg(1.0 / gain64)
    return {
        "axes_dim": axes.numel(),
        "semi_axis_max": largest,
        "semi_axis_min": smallest,
        "condition": largest / smallest if smallest > 0 else math.inf,
        "normal_ones_deg": normal,
        "bias_ones_deg": angle_with_ones_deg(bias) if bias is not None else None,
        "bias_norm": float(bias.detach().to(torch.float64).norm()) if bias is not None else None,
    }


def _full(param: object) -> torch.Tensor | None:
    """The whole tensor of a parameter; an FSDP2-sharded one is all-gathered (a collective: every rank
    calls)."""
    if not isinstance(param, torch.Tensor):
        return None
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def ellipsoid_rows(
    norms: Sequence[NormSite], *, model: str, norm: str, step: int | None, tokens_seen: int | None
) -> list[dict]:
    """One row per LayerNorm/RMSNorm with a gain (``ELLIPSOID_FIELDS``); other norms are skipped. Call it on
    every rank: FSDP2-sharded gains are all-gathered."""

    rows = []
    # The eigvalsh of a d x d matrix per norm: 30 ms at d=512 on one CPU thread, seconds on two busy ones.
    with one_cpu_thread(torch.device("cpu")):
        for site in norms:
            if site.kind not in STANDARDIZABLE_KINDS:
                continue  # an element-wise squashing (DyT) has no output ellipsoid
            gain, bias = (_full(getattr(site.module, name, None)) for name in ("weight", "bias"))
            if gain is None or gain.numel() != site.dim:
                continue
            bias = bias if bias is not None and bias.numel() == site.dim else None
            geometry = norm_geometry(gain, bias, centered=site.kind == "layer")
            row = {
                "model": model, "norm": norm, "step": step, "tokens_seen": tokens_seen, "layer": site.layer,
                "site": site.role, "kind": site.kind, "dim": site.dim,
            }
            row.update(
                {k: v if k == "axes_dim" or v is None else json_number(v) for k, v in geometry.items()}
            )
            rows.append(row)
    return rows


class EllipsoidMeasurement(Measurement):
    """``ellipsoid.jsonl``: read from the norms' gains and biases when the records are made; no token
    needed."""

    def __init__(self, norms: Sequence[NormSite]) -> None:
        self.norms = list(norms)

    def records(self, where: RecordKeys) -> dict[str, list[dict]]:
        return {ELLIPSOID_FILE: ellipsoid_rows(self.norms, **where)}
