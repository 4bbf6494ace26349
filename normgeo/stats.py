"""Streaming statistics of angles and norms: the one engine behind the training probe and ``analyze.py``.

For S sites and R reference vectors it keeps, per (site, reference): count, mean, M2 (Welford/Chan),
min, max and a fixed-bin histogram of the angle in degrees; per site: the count of zero vectors and
the moments of ||x||. Memory is O(S * R * bins), independent of how many tokens stream through, and
two instances (two batches, two ranks) merge exactly with Chan's parallel formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

QUANTILES = (0.01, 0.05, 0.25, 0.50, 0.75, 0.95, 0.99)
QUANTILE_FIELDS = tuple(f"p{round(q * 100):02d}" for q in QUANTILES)
DEFAULT_BINS_PER_DEGREE = 40  # 0.025 deg bins: interpolated quantiles are within 0.025 deg


def _chan_merge(
    count_a: torch.Tensor, mean_a: torch.Tensor, m2_a: torch.Tensor,
    count_b: torch.Tensor, mean_b: torch.Tensor, m2_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine (count, mean, M2) of two disjoint samples (Chan, Golub & LeVeque 1979)."""
    total = count_a + count_b
    safe = total.clamp(min=1)
    delta = mean_b - mean_a
    mean = mean_a + delta * count_b / safe
    m2 = m2_a + m2_b + delta.square() * count_a * count_b / safe
    return total, mean, m2


class AngleStatistics:
    """Angles (degrees) of token vectors with reference vectors, and their norms, at S sites."""

    def __init__(
        self,
        num_sites: int,
        references: torch.Tensor,
        bins_per_degree: int = DEFAULT_BINS_PER_DEGREE,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.num_sites = num_sites
        self.bins_per_degree = bins_per_degree
        self.num_bins = 180 * bins_per_degree
        # Unit references in float32 for the matmul; the angle itself is finished in float64.
        refs = references.to(self.device, torch.float64)
        self.ref_units = (refs / refs.norm(dim=-1, keepdim=True)).to(torch.float32)
        self.num_refs = refs.shape[0]
        shape = (num_sites, self.num_refs)
        f64 = {"dtype": torch.float64, "device": self.device}
        self.count = torch.zeros(shape, **f64)
        self.mean = torch.zeros(shape, **f64)
        self.m2 = torch.zeros(shape, **f64)
        self.min = torch.full(shape, math.inf, **f64)
        self.max = torch.full(shape, -math.inf, **f64)
        self.hist = torch.zeros((*shape, self.num_bins), dtype=torch.int64, device=self.device)
        self.zero_count = torch.zeros(num_sites, **f64)
        self.norm_count = torch.zeros(num_sites, **f64)
        self.norm_mean = torch.zeros(num_sites, **f64)
        self.norm_m2 = torch.zeros(num_sites, **f64)

    @torch.no_grad()
    def update(self, site: int, vectors: torch.Tensor) -> None:
        """Add every vector of ``vectors`` (..., d) at ``site``; bf16/fp16 inputs are cast up first."""
        x = vectors.detach().reshape(-1, vectors.shape[-1]).to(torch.float32)
        norms = x.norm(dim=-1)
        self._update_norms(site, norms.to(torch.float64))
        nonzero = norms > 0
        if not bool(nonzero.all()):
            self.zero_count[site] += (~nonzero).sum()
            x, norms = x[nonzero], norms[nonzero]
        if x.shape[0] == 0:
            return
        cosines = (x @ self.ref_units.T).to(torch.float64) / norms.to(torch.float64).unsqueeze(1)
        degrees = torch.rad2deg(torch.arccos(cosines.clamp(-1.0, 1.0)))  # (n, R)
        n = torch.tensor(float(degrees.shape[0]), dtype=torch.float64, device=self.device)
        batch_mean = degrees.mean(dim=0)
        batch_m2 = (degrees - batch_mean).square().sum(dim=0)
        self.count[site], self.mean[site], self.m2[site] = _chan_merge(
            self.count[site], self.mean[site], self.m2[site], n, batch_mean, batch_m2
        )
        self.min[site] = torch.minimum(self.min[site], degrees.min(dim=0).values)
        self.max[site] = torch.maximum(self.max[site], degrees.max(dim=0).values)
        bins = (degrees * self.bins_per_degree).long().clamp_(0, self.num_bins - 1)
        flat = bins + torch.arange(self.num_refs, device=self.device) * self.num_bins
        self.hist[site] += torch.bincount(flat.reshape(-1), minlength=self.num_refs * self.num_bins).view(
            self.num_refs, self.num_bins
        )

    def _update_norms(self, site: int, norms: torch.Tensor) -> None:
        n = torch.tensor(float(norms.shape[0]), dtype=torch.float64, device=self.device)
        batch_mean = norms.mean()
        batch_m2 = (norms - batch_mean).square().sum()
        self.norm_count[site], self.norm_mean[site], self.norm_m2[site] = _chan_merge(
            self.norm_count[site], self.norm_mean[site], self.norm_m2[site], n, batch_mean, batch_m2
        )

    def merge(self, other: AngleStatistics) -> None:
        """Fold in statistics of a disjoint set of tokens (another batch, another rank)."""
        self.count, self.mean, self.m2 = _chan_merge(
            self.count, self.mean, self.m2, other.count, other.mean, other.m2
        )
        self.min = torch.minimum(self.min, other.min)
        self.max = torch.maximum(self.max, other.max)
        self.hist += other.hist
        self.zero_count += other.zero_count
        self.norm_count, self.norm_mean, self.norm_m2 = _chan_merge(
            self.norm_count, self.norm_mean, self.norm_m2, other.norm_count, other.norm_mean, other.norm_m2
        )

    _MOMENT_FIELDS = ("count", "mean", "m2", "min", "max", "zero_count", "norm_count", "norm_mean", "norm_m2")

    def all_reduce(self) -> None:
        """Merge the statistics of every rank into every rank (no-op outside torch.distributed).

        Moments are gathered and merged in rank order with Chan's formula, so all ranks hold the same
        numbers, equal to a single process's up to float rounding; histograms are summed exactly.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        packed = torch.cat([getattr(self, f).reshape(-1) for f in self._MOMENT_FIELDS])
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, packed)
        dist.all_reduce(self.hist)
        hist = self.hist
        merged: AngleStatistics | None = None
        for flat in gathered:
            part = self._empty_like()
            offset = 0
            for field in self._MOMENT_FIELDS:
                target = getattr(part, field)
                target.copy_(flat[offset : offset + target.numel()].view_as(target))
                offset += target.numel()
            if merged is None:
                merged = part
            else:
                merged.merge(part)
        assert merged is not None
        for field in self._MOMENT_FIELDS:
            setattr(self, field, getattr(merged, field))
        self.hist = hist

    def _empty_like(self) -> AngleStatistics:
        empty = AngleStatistics.__new__(AngleStatistics)
        empty.__dict__.update(self.__dict__)
        for field in self._MOMENT_FIELDS:
            setattr(empty, field, torch.zeros_like(getattr(self, field)))
        empty.hist = torch.zeros(0, dtype=torch.int64)  # histograms are reduced separately
        return empty

    def std(self) -> torch.Tensor:
        """Population standard deviation of the angles, (S, R)."""
        return (self.m2 / self.count.clamp(min=1)).sqrt()

    def norm_std(self) -> torch.Tensor:
        return (self.norm_m2 / self.norm_count.clamp(min=1)).sqrt()

    def quantiles(self, quantiles: Sequence[float] = QUANTILES) -> torch.Tensor:
        """Quantiles (S, R, Q) in degrees, linearly interpolated inside the histogram bins.

        The error is at most one bin width (1 / bins_per_degree degrees); the result is clamped into
        the exact [min, max] so a narrow distribution is not widened to the bin edges.
        """
        hist = self.hist.to(torch.float64)
        cumulative = hist.cumsum(dim=-1)
        total = cumulative[..., -1:]
        q = torch.tensor(quantiles, dtype=torch.float64, device=self.device)
        targets = q * total  # (S, R, Q)
        index = torch.searchsorted(cumulative.contiguous(), targets.contiguous()).clamp(max=self.num_bins - 1)
        below = torch.where(index > 0, cumulative.gather(-1, (index - 1).clamp(min=0)), torch.zeros_like(targets))
        in_bin = hist.gather(-1, index).clamp(min=1)
        fraction = ((targets - below) / in_bin).clamp(0, 1)
        degrees = (index.to(torch.float64) + fraction) / self.bins_per_degree
        degrees = torch.maximum(torch.minimum(degrees, self.max.unsqueeze(-1)), self.min.unsqueeze(-1))
        return torch.where(total > 0, degrees, torch.full_like(degrees, math.nan))
