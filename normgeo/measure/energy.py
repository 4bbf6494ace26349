"""What mean subtraction removes, per token, at every norm input: streamed like :mod:`normgeo.measure.stats`.

For a token vector x in R^d, LayerNorm's centering removes its component along 1, a fraction

    f = (x . 1)^2 / (d ||x||^2) = cos^2(angle(x, 1))  =  mean(x)^2 / mean(x^2)

of its energy ||x||^2 (RMSNorm keeps it). Next to it, the Jacobian scale proxy sqrt(d) / ||x||: a norm's
Jacobian has spectral norm O(d / ||x||) (Xiong et al. 2020, seed 004), which for the typical input of norm
sqrt(d) sigma is sqrt(d) / ||x|| up to the gain. Per site: count, mean, M2 (Chan merge), min, max and a
log-spaced histogram of each quantity for quantiles; O(sites x bins) memory whatever the token count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from normgeo.measure.measurement import Measurement, ProbeBatch, RecordKeys
from normgeo.measure.norm_sites import NormSite
from normgeo.measure.probe import input_sites
from normgeo.measure.stats import (
    QUANTILE_FIELDS,
    QUANTILES,
    add_counts,
    chan_merge,
    distributed,
    histogram_position,
    json_number,
    one_cpu_thread,
)
from normgeo.run_folder import ENERGY_FILE

QUANTITIES = ("ones_fraction", "jacobian_proxy")
# log10 ranges of the histograms, 100 bins per decade (quantiles within a factor 10^0.01 = 2.3%).
LOG10_RANGE = {"ones_fraction": (-12.0, 0.0), "jacobian_proxy": (-6.0, 6.0)}
BINS_PER_DECADE = 100


class EnergyStatistics:
    """Streamed fraction of ||x||^2 along 1 and sqrt(d)/||x|| of the nonzero token vectors at S sites."""

    _MOMENTS = ("count", "mean", "m2", "min", "max")

    def __init__(self, num_sites: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.num_sites = num_sites
        q = len(QUANTITIES)
        f64 = {"dtype": torch.float64, "device": self.device}
        self.count = torch.zeros((num_sites, q), **f64)
        self.mean = torch.zeros((num_sites, q), **f64)
        self.m2 = torch.zeros((num_sites, q), **f64)
        self.min = torch.full((num_sites, q), math.inf, **f64)
        self.max = torch.full((num_sites, q), -math.inf, **f64)
        self.low = torch.tensor([LOG10_RANGE[name][0] for name in QUANTITIES], **f64)
        high = torch.tensor([LOG10_RANGE[name][1] for name in QUANTITIES], **f64)
        self.num_bins = int(round(float((high - self.low).max()))) * BINS_PER_DECADE
        self.hist = torch.zeros((num_sites, q, self.num_bins), dtype=torch.int64, device=self.device)
        self.bin_offsets = torch.arange(q, device=self.device) * self.num_bins  # each quantity's histogram

    @staticmethod
    def quantities(vectors: torch.Tensor) -> torch.Tensor:
        """(n, 2) float64: the fraction along 1 and sqrt(d)/||x|| of the nonzero rows of ``vectors`` (..., d).

        The two reductions over d run in float32 (a float64 copy of the activations would cost as much as
        the rest of the probe); their error is ~1e-7 of ||x||, so a fraction below ~1e-12 is rounding.
        """
        values, directed = EnergyStatistics.masked_quantities(vectors)
        return values[directed.squeeze(1)]

    @staticmethod
    def masked_quantities(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`quantities` of every row, and which rows are nonzero ((n, 1) bool): the rows of zero
        vectors hold 1 (of no consequence) rather than being dropped, which a GPU would have to count for the
        host."""
        x = vectors.detach().reshape(-1, vectors.shape[-1])
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        dim = x.shape[-1]
        along = x.sum(dim=-1).to(torch.float64)
        length = torch.linalg.vector_norm(x, dim=-1).to(torch.float64)
        directed = (length > 0).unsqueeze(1)
        fraction = (along / length).square() / dim
        values = torch.stack([fraction.clamp(max=1.0), math.sqrt(dim) / length], dim=1)
        return torch.where(directed, values, 1.0), directed

    @torch.no_grad()
    def update(self, site: int, vectors: torch.Tensor) -> None:
        self.update_quantities(site, *self.masked_quantities(vectors.to(self.device)))

    @torch.no_grad()
    def update_quantities(self, site: int, values: torch.Tensor, directed: torch.Tensor) -> None:
        """Add the rows of ``values`` (n, 2) (:meth:`masked_quantities`) where ``directed`` (n, 1) is true:
        the caller may mask out more rows than the zero vectors (mean_sources' document starts)."""
        # Zero vectors are masked out of every statistic rather than dropped: no count read back from a GPU.
        # Where there are none, every sum, extreme and bin is the same as over the nonzero rows alone.
        count = directed.sum(dtype=torch.float64)  # 0-d
        batch_mean = torch.where(directed, values, 0.0).sum(dim=0) / count.clamp(min=1)
        batch_m2 = torch.where(directed, values - batch_mean, 0.0).square().sum(dim=0)
        self.count[site], self.mean[site], self.m2[site] = chan_merge(
            self.count[site], self.mean[site], self.m2[site], count, batch_mean, batch_m2
        )
        self.min[site] = torch.minimum(self.min[site], torch.where(directed, values, math.inf).amin(dim=0))
        self.max[site] = torch.maximum(self.max[site], torch.where(directed, values, -math.inf).amax(dim=0))
        # log10(0) = -inf lands in the first bin, like every value below the range.
        logs = torch.log10(values).nan_to_num(neginf=-1e9)
        bins = ((logs - self.low) * BINS_PER_DECADE).floor().clamp_(0, self.num_bins - 1).long()
        add_counts(self.hist[site].view(-1), bins + self.bin_offsets, directed)

    def merge(self, other: EnergyStatistics) -> None:
        """Fold in the statistics of a disjoint set of tokens (another batch or rank)."""
        self.count, self.mean, self.m2 = chan_merge(
            self.count, self.mean, self.m2, other.count, other.mean, other.m2
        )
        self.min = torch.minimum(self.min, other.min)
        self.max = torch.maximum(self.max, other.max)
        self.hist += other.hist

    def all_reduce(self) -> None:
        """Merge every rank's statistics into every rank, in rank order (no-op outside torch.distributed)."""
        if not distributed():
            return
        packed = torch.stack([getattr(self, field) for field in self._MOMENTS])
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, packed)
        dist.all_reduce(self.hist)
        hist = self.hist
        for field in self._MOMENTS:
            setattr(self, field, gathered[0][self._MOMENTS.index(field)].clone())
        for part in gathered[1:]:
            other = EnergyStatistics.__new__(EnergyStatistics)
            other.__dict__.update({field: part[i] for i, field in enumerate(self._MOMENTS)})
            other.hist = torch.zeros_like(hist)
            self.merge(other)

    def std(self) -> torch.Tensor:
        return (self.m2 / self.count.clamp(min=1)).sqrt()

    def quantiles(self, quantiles: Sequence[float] = QUANTILES) -> torch.Tensor:
        """(S, 2, Q) quantiles, interpolated log-linearly inside a bin and clamped into the exact
        [min, max]."""
        position, total = histogram_position(self.hist, quantiles)
        logs = self.low.view(1, -1, 1) + position / BINS_PER_DECADE
        values = torch.maximum(torch.minimum(10.0**logs, self.max.unsqueeze(-1)), self.min.unsqueeze(-1))
        return torch.where(total > 0, values, torch.full_like(values, math.nan))


def energy_rows(
    sites: Sequence,
    stats: EnergyStatistics,
    *,
    model: str,
    norm: str,
    step: int | None,
    tokens_seen: int | None,
) -> list[dict]:
    """One row per (site, quantity) for ``energy.jsonl``; ``sites`` are the probe's norm-input sites."""

    count, mean, std = stats.count.cpu(), stats.mean.cpu(), stats.std().cpu()
    low, high, quantiles = stats.min.cpu(), stats.max.cpu(), stats.quantiles().cpu()
    rows = []
    for s, site in enumerate(sites):
        for q, quantity in enumerate(QUANTITIES):
            row = {
                "model": model, "norm": norm, "step": step, "tokens_seen": tokens_seen, "layer": site.layer,
                "site": site.site, "quantity": quantity, "dim": site.dim, "count": int(count[s, q]),
                "mean": json_number(mean[s, q]), "std": json_number(std[s, q]),
                "min": json_number(low[s, q]), "max": json_number(high[s, q]),
            }
            row.update({name: json_number(quantiles[s, q, i]) for i, name in enumerate(QUANTILE_FIELDS)})
            rows.append(row)
    return rows


class EnergyMeasurement(Measurement):
    """``energy.jsonl``: what centering removes at every norm input (site k is the k-th norm's input)."""

    def __init__(self, norms: Sequence[NormSite], device: torch.device | str = "cpu",
                 stats: EnergyStatistics | None = None) -> None:
        self.norms = list(norms)
        self.stats = stats if stats is not None else EnergyStatistics(len(self.norms), device=device)

    def observe_norm(self, index: int, norm: NormSite, inputs: torch.Tensor, output: torch.Tensor,
                     batch: ProbeBatch) -> None:
        with one_cpu_thread(self.stats.device):
            self.stats.update(index, inputs)

    def all_reduce(self) -> None:
        self.stats.all_reduce()

    def records(self, where: RecordKeys) -> dict[str, list[dict]]:
        return {ENERGY_FILE: energy_rows(input_sites(self.norms), self.stats, **where)}
