"""Where the mean lives: which positions and feature dimensions carry each norm input's component along 1.

For a token vector x in R^d with mean mu(x) = (1/d) sum_i x_i, LayerNorm's centering removes mu^2 d of its
energy (the fraction ``ones_fraction`` = mu^2 / mean(x^2) of :mod:`normgeo.measure.energy`). Streamed at every
norm input, like the energy:

- by position bucket (the token's position in its probe window: 0, 1-3, 4-15, 16-63, 64-255, 256+), the
  energy fraction along 1 (count, mean, std, min, max, quantiles: one :class:`EnergyStatistics` site per
  (site, bucket)) and the bucket's sum of mu^2; the same over the tokens that begin a document of the
  packed probe stream (``doc_start``, from :attr:`ProbeBatch.document_starts`), which overlaps the
  position buckets rather than being one of them;
- by feature dimension, the exact decomposition of E[mu^2]: phi_i = E[mu x_i / d] sums over i to E[mu^2]
  (sum_i mu x_i / d = mu^2 for every token), accumulated in float64;
- massive dimensions (Sun et al. 2024): the per-dimension max |x_i| over the probed tokens against 100x the
  exact median |x| over all entries of the site: a histogram of |x| by the float32 exponent and leading
  mantissa bits finds the median's bin, and the MEDIAN_BAND bins around the first batch's median count every
  float32 value apart, so the median is exact when it lands in them (``median_exact``; else the bin's middle,
  within 1.6%, and a warning).
- per document of the probe stream (:attr:`ProbeBatch.documents`; more than MAX_UNITS documents fold into
  MAX_UNITS groups, document k in group k mod MAX_UNITS), the sums of mu^2, of mu^2 at position 0 and of
  phi_i: the headline shares (position 0, top 8, massive) get 95% intervals from a bootstrap over documents
  (:func:`normgeo.measure.stats.block_bootstrap_means`), not over windows of one long article.

Every part is a sum, a max or a histogram of the tokens, so two batches or two ranks merge exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from normgeo.measure.energy import QUANTITIES, EnergyStatistics
from normgeo.measure.geometry import reads_back
from normgeo.measure.measurement import Measurement, ProbeBatch, RecordKeys
from normgeo.measure.norm_sites import NormSite
from normgeo.measure.probe import ProbeSite, input_sites
from normgeo.measure.stats import (
    QUANTILE_FIELDS,
    add_counts,
    block_bootstrap_means,
    distributed,
    json_number,
    one_cpu_thread,
)
from normgeo.run_folder import MEAN_SOURCES_FILE

log = logging.getLogger(__name__)

# First position of each bucket; a bucket runs to the next one's start (the last one is open).
BUCKET_STARTS = (0, 1, 4, 16, 64, 256)
# The bucket of the tokens that begin a document (any window position): after the position buckets, which
# partition the tokens, it overlaps them.
DOC_START = "doc_start"
TOP_DIMS = 16  # dimensions listed by |phi_i|
SHARE_TARGET = 0.9  # dims_for_90: dimensions needed for this share of E[mu^2]
MASSIVE_RATIO = 100.0  # a massive dimension's max |x_i| exceeds this many median |x|
MASSIVE_LISTED = 64  # at most this many massive dimensions listed (massive_count counts them all)
# |x| histogram: one bin per float32 exponent and leading ABS_MANTISSA_BITS mantissa bits (bins 2^-5 = 3% wide
# relative to their lower edge, every float32 magnitude from 0 to inf).
ABS_MANTISSA_BITS = 5
ABS_BINS = 1 << (8 + ABS_MANTISSA_BITS)
ABS_SHIFT = 23 - ABS_MANTISSA_BITS  # float32 bits below the bin's
# The exact median: per site, MEDIAN_BAND histogram bins (centred on the first batch's median bin) keep a
# count per float32 value (their remaining ABS_SHIFT mantissa bits): MEDIAN_BAND * 2^18 int32, 5 MiB a site.
MEDIAN_BAND = 5
FINE_BINS = 1 << ABS_SHIFT
BAND_SLOTS = MEDIAN_BAND * FINE_BINS  # one per float32 value of the band
MAX_UNITS = 256  # resampling units of the bootstrap over documents (documents beyond fold into groups)
CHUNK_TOKENS = 1024  # CPU: tokens per chunk of the passes over every entry (float64: 4.5 MiB at d = 576)
FRACTION = QUANTITIES.index("ones_fraction")


def bucket_names(starts: Sequence[int] = BUCKET_STARTS) -> list[str]:
    """"0", "1-3", ..., "256+": each bucket's positions."""
    ends = [*starts[1:], None]
    return [
        f"{start}+" if end is None else (str(start) if end == start + 1 else f"{start}-{end - 1}")
        for start, end in zip(starts, ends, strict=True)
    ]


def empty_buckets(longest_window: int, starts: Sequence[int] = BUCKET_STARTS) -> list[str]:
    """The buckets that windows of at most ``longest_window`` tokens never reach (their rows hold count 0)."""
    return [name for name, start in zip(bucket_names(starts), starts, strict=True) if start >= longest_window]


def magnitude_bits(vectors: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """|x| of every entry as its float32 bits (the sign bit cleared), into ``out`` (int32, vectors' shape)
    if given: the |x| histogram's bin is their top bits (the exponent and ABS_MANTISSA_BITS of the
    mantissa), log-spaced bins by a shift where log10 would cost passes more."""
    return torch.bitwise_and(vectors.float().view(torch.int32), 0x7FFFFFFF, out=out)


class MeanSourcesStatistics:
    """Streamed mean sources at S norm inputs of widths ``dims``: position buckets and document starts,
    phi_i, max |x_i|, |x| histogram. :meth:`merge` and :meth:`all_reduce` are sums (and maxima) of the
    per-rank state."""

    _SUMMED = ("count", "mean_sq", "bucket_mean_sq", "abs_hist", "unit_mean_sq", "unit_first_sq")

    def __init__(self, dims: Sequence[int], device: torch.device | str = "cpu", documents: int = 0) -> None:
        """``documents``: how many documents the probe stream holds (0: unknown, no intervals)."""
        self.device = torch.device(device)
        self.dims = list(dims)
        self.num_sites = len(self.dims)
        self.num_buckets = len(BUCKET_STARTS)
        self.slots = self.num_buckets + 1  # per site: the position buckets, then the document starts
        f64 = {"dtype": torch.float64, "device": self.device}
        self.buckets = EnergyStatistics(self.num_sites * self.slots, device=self.device)
        self.count = torch.zeros(self.num_sites, **f64)  # tokens
        self.mean_sq = torch.zeros(self.num_sites, **f64)  # sum over tokens of mu^2
        self.bucket_mean_sq = torch.zeros((self.num_sites, self.slots), **f64)
        self.phi = [torch.zeros(d, **f64) for d in self.dims]  # sum over tokens of mu x_i / d
        self.max_abs = [torch.zeros(d, **f64) for d in self.dims]
        self.abs_hist = torch.zeros((self.num_sites, ABS_BINS), dtype=torch.int64, device=self.device)
        self.starts = torch.tensor(BUCKET_STARTS, device=self.device)  # once: no host copy per update
        # Per site: the histogram bin that band_hist's counts per float32 value start at (its origin), and
        # the bins [band_low, band_high) whose every entry they count (a merge keeps the bins both sides
        # counted); -1: not yet chosen.
        self.band_start = torch.full((self.num_sites,), -1, dtype=torch.int64, device=self.device)
        self.band_low, self.band_high = self.band_start.clone(), self.band_start.clone()
        self.band_hist = torch.zeros((self.num_sites, BAND_SLOTS), dtype=torch.int32,
                                     device=self.device)
        self.band_started = [False] * self.num_sites
        self.documents = documents
        self.units = min(documents, MAX_UNITS)
        self.unit_mean_sq = torch.zeros((self.num_sites, self.units), **f64)  # per unit: sum of mu^2
        self.unit_first_sq = torch.zeros((self.num_sites, self.units), **f64)  # ... at position 0
        self.unit_phi = [torch.zeros((self.units, d), **f64) for d in self.dims]  # ... of mu x_i / d
        self.buffers: dict[str, torch.Tensor] = {}  # scratch()'s

    @torch.no_grad()
    def update(self, site: int, vectors: torch.Tensor, document_starts: torch.Tensor | None = None,
               documents: torch.Tensor | None = None) -> None:
        """Add the token vectors ``vectors`` (rows, T, d) of probe windows (position = index along T) at
        ``site``; a 2-d (T, d) tensor is one window. ``document_starts`` (rows, T) bool: the tokens that
        begin a document (None: unknown, the ``doc_start`` row stays empty). ``documents`` (rows, T) int:
        the document of the probe stream each token belongs to (None, or no ``documents`` at
        construction: no per-document sums)."""
        x = vectors.detach().to(self.device)
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        x = x.reshape(-1, *x.shape[-2:]) if x.dim() != 2 else x.unsqueeze(0)
        rows, length, dim = x.shape
        # The fraction along 1 of every token once; the buckets and the document starts take their tokens
        # from it (a second pass over d for the document starts would cost as much as the buckets').
        values, directed = EnergyStatistics.masked_quantities(x)
        values, directed = values.view(rows, length, -1), directed.view(rows, length, 1)
        for b, start in enumerate(BUCKET_STARTS):
            if start < length:
                end = BUCKET_STARTS[b + 1] if b + 1 < self.num_buckets else length
                self.buckets.update_quantities(site * self.slots + b, values[:, start:end].reshape(-1, 2),
                                               directed[:, start:end].reshape(-1, 1))
        starts = None
        if document_starts is not None:  # masked, not selected: selecting would read a count back
            starts = document_starts.to(self.device).reshape(rows, length)
            self.buckets.update_quantities(site * self.slots + self.num_buckets, values.view(-1, 2),
                                           (directed & starts.unsqueeze(-1)).view(-1, 1))
        flat = x.reshape(-1, dim)
        # A GPU takes the batch in one piece: chunks would only multiply its launches.
        chunk_tokens = CHUNK_TOKENS if self.device.type == "cpu" else len(flat)
        units = None
        if documents is not None and self.units:
            units = documents.to(self.device).reshape(-1).remainder(self.units)
        if not self.band_started[site]:  # the band is centred on this first batch's median bin: counted first
            for chunk in flat.split(chunk_tokens):
                add_counts(self.abs_hist[site], magnitude_bits(chunk) >> ABS_SHIFT)
            self.start_band(site)
            counted = True
        else:
            counted = False
        # Every pass over the entries goes chunk by chunk into buffers that every chunk and site reuse: a
        # chunk's temporaries stay in the cache, and no pass faults in fresh pages (a new temporary of a few
        # MB often does: glibc maps it, or trims the heap it came from, when it is freed).
        means = []
        band = self.band_hist[site]
        # A value's slot in the band is its bits past the band's first value: (bin - start) * FINE_BINS plus
        # its low mantissa bits. An int32 origin: a 0-d int64 one would send the subtraction down a cast.
        low = (self.band_start[site] << ABS_SHIFT).to(torch.int32)
        for number, chunk in enumerate(flat.split(chunk_tokens)):
            shape = chunk.shape
            # float64 for the decomposition: sum_i phi_i = E[mu^2] to rounding only when mu, phi are one sum.
            wide = self.scratch("wide", shape, torch.float64).copy_(chunk)
            mu = wide.mean(dim=-1)
            self.phi[site] += mu @ wide / dim
            if units is not None:
                rows_of = units[number * chunk_tokens : number * chunk_tokens + len(chunk)]
                self.unit_phi[site].index_add_(0, rows_of, wide.mul_((mu / dim).unsqueeze(-1)))
            means.append(mu)
            bits = magnitude_bits(chunk, out=self.scratch("bits", shape, torch.int32))
            magnitude = bits.view(torch.float32).amax(dim=0).to(torch.float64)
            self.max_abs[site] = torch.maximum(self.max_abs[site], magnitude)
            if not counted:
                bins = self.scratch("bins", shape, torch.int32)
                add_counts(self.abs_hist[site], torch.bitwise_right_shift(bits, ABS_SHIFT, out=bins))
            slots = bits.sub_(low)  # below the band: negative
            if reads_back(self.device):
                # One unsigned comparison (an entry below the band wraps past it) and numpy's selection: the
                # band's entries alone, counted in a third of the time of two comparisons and masked_select.
                entries = slots.numpy().reshape(-1)
                inside = np.less(entries.view(np.uint32), BAND_SLOTS,
                                 out=self.scratch("inside", shape, torch.bool).numpy().reshape(-1))
                add_counts(band, torch.from_numpy(entries[inside]))
            else:
                inside = torch.ge(slots, 0, out=self.scratch("inside", shape, torch.bool))
                inside &= torch.lt(slots, BAND_SLOTS, out=self.scratch("below", shape, torch.bool))
                # Clamped into the band: a GPU's index_add_ weighs the entries outside by 0 but indexes them.
                add_counts(band, slots.clamp_(0, BAND_SLOTS - 1).view(-1), inside.view(-1))
        square = torch.cat(means).view(x.shape[:2]).square()  # (rows, T)
        if units is not None:
            self.unit_mean_sq[site].index_add_(0, units, square.reshape(-1))
            self.unit_first_sq[site].index_add_(0, units.view(rows, length)[:, 0], square[:, 0])
        self.count[site] += float(square.numel())
        self.mean_sq[site] += square.sum()
        bucket = torch.bucketize(torch.arange(length, device=self.device), self.starts, right=True) - 1
        self.bucket_mean_sq[site, : self.num_buckets].index_add_(0, bucket, square.sum(dim=0))
        if starts is not None:
            self.bucket_mean_sq[site, self.num_buckets] += torch.where(starts, square, 0.0).sum()

    def scratch(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` for the chunk loop's ``name``d temporary, one allocation reused by every
        chunk and site (as large as the largest chunk so far)."""
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buffer[:size].view(shape)

    def start_band(self, site: int) -> None:
        """Centre ``site``'s median band on its histogram's median bin so far, on the device (no sync)."""
        middle = self.histogram_median_bin(self.abs_hist[site : site + 1])[0]
        self.band_start[site] = (middle - MEDIAN_BAND // 2).clamp(0, ABS_BINS - MEDIAN_BAND)
        self.band_low[site] = self.band_start[site]
        self.band_high[site] = self.band_start[site] + MEDIAN_BAND
        self.band_started[site] = True

    def merge(self, other: MeanSourcesStatistics) -> None:
        """Fold in the statistics of a disjoint set of tokens (another batch or rank). The median bands add
        up over the bins both counted (an unstarted one takes the other's)."""
        self.buckets.merge(other.buckets)
        for field in self._SUMMED:
            setattr(self, field, getattr(self, field) + getattr(other, field))
        self.phi = [a + b for a, b in zip(self.phi, other.phi, strict=True)]
        self.unit_phi = [a + b for a, b in zip(self.unit_phi, other.unit_phi, strict=True)]
        self.max_abs = [torch.maximum(a, b) for a, b in zip(self.max_abs, other.max_abs, strict=True)]
        hist = self.band_hist.clone()
        for s in range(self.num_sites):
            if not other.band_started[s]:
                continue
            if not self.band_started[s]:
                hist[s] = other.band_hist[s]
                for field in ("band_start", "band_low", "band_high"):
                    getattr(self, field)[s] = getattr(other, field)[s]
                self.band_started[s] = True
                continue
            low = max(int(self.band_low[s]), int(other.band_low[s]))
            high = min(int(self.band_high[s]), int(other.band_high[s]))
            origin = int(self.band_start[s])
            hist[s] = self.rebased(self.band_hist[s], origin, low, high, origin)
            hist[s] += self.rebased(other.band_hist[s], int(other.band_start[s]), low, high, origin)
            self.band_low[s], self.band_high[s] = low, max(low, high)
        self.band_hist = hist

    def all_reduce(self) -> None:
        """Every rank's sums and maxima into every rank (no-op outside torch.distributed)."""
        self.buckets.all_reduce()
        if not distributed():
            return
        for field in self._SUMMED:
            dist.all_reduce(getattr(self, field))
        phi, max_abs = torch.cat(self.phi), torch.cat(self.max_abs)
        dist.all_reduce(phi)
        dist.all_reduce(max_abs, op=dist.ReduceOp.MAX)
        self.phi, self.max_abs = list(phi.split(self.dims)), list(max_abs.split(self.dims))
        unit_phi = torch.cat([u.reshape(-1) for u in self.unit_phi])
        dist.all_reduce(unit_phi)
        sizes = [self.units * d for d in self.dims]
        self.unit_phi = [u.view(self.units, d) for u, d in zip(unit_phi.split(sizes), self.dims, strict=True)]
        # Each rank chose its bands from its own first batch: they add up over the bins every rank counted,
        # re-based to the first of those.
        dist.all_reduce(self.band_low, op=dist.ReduceOp.MAX)
        dist.all_reduce(self.band_high, op=dist.ReduceOp.MIN)
        for s in range(self.num_sites):
            low, high = int(self.band_low[s]), int(self.band_high[s])
            self.band_hist[s] = self.rebased(self.band_hist[s], int(self.band_start[s]), low, high, low)
            self.band_start[s], self.band_high[s] = low, max(low, high)
        dist.all_reduce(self.band_hist)

    @staticmethod
    def rebased(hist: torch.Tensor, start: int, low: int, high: int, origin: int) -> torch.Tensor:
        """A site's band counts ``hist`` (origin bin ``start``) with only the bins [low, high), moved to
        origin bin ``origin``."""
        out = torch.zeros_like(hist)
        for bin_ in range(low, high):
            source, target = (bin_ - start) * FINE_BINS, (bin_ - origin) * FINE_BINS
            if 0 <= target < BAND_SLOTS:
                out[target : target + FINE_BINS] = hist[source : source + FINE_BINS]
        return out

    @staticmethod
    def histogram_median_bin(hist: torch.Tensor) -> torch.Tensor:
        """(S,) the bin of the (lower) median entry of each row of ``hist`` (S, ABS_BINS)."""
        cumulative = hist.cumsum(dim=-1)
        total = cumulative[:, -1:]
        return torch.searchsorted(cumulative.contiguous(), (total + 1) // 2).squeeze(-1)

    def median_abs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """((S,) float64, (S,) bool): the median |x| over all entries of each site (the lower median, the
        ((n + 1) // 2)-th smallest, as torch.median), and whether it is exact: the median entry fell in the
        bins of the site's band that every batch counted per float32 value. Elsewhere the middle of the
        histogram bin that holds it (within 1.6%). NaN (and not exact) for a site with no token."""
        index = self.histogram_median_bin(self.abs_hist)
        total = self.abs_hist.sum(dim=-1)
        # The bin's lower and upper edges are the float32 numbers whose bits start with the bin's index.
        edges = torch.stack([index, index + 1]).clamp(max=ABS_BINS - 1).to(torch.int32) << ABS_SHIFT
        low, high = edges.view(torch.float32).to(torch.float64)
        median = torch.where(total > 0, (low + high) / 2, math.nan)
        exact = torch.zeros(self.num_sites, dtype=torch.bool)
        for s in range(self.num_sites):
            start = int(self.band_start[s])
            if start < 0 or not int(self.band_low[s]) <= int(index[s]) < int(self.band_high[s]):
                continue
            # The rank of the median entry within its histogram bin, whose every entry the band counted (the
            # histogram's count of the bin is theirs): those in bins below it come first.
            rank = (int(total[s]) + 1) // 2 - int(self.abs_hist[s, : int(index[s])].sum())
            first = (int(index[s]) - start) * FINE_BINS
            cumulative = self.band_hist[s, first : first + FINE_BINS].long().cumsum(dim=0)
            value = int(torch.searchsorted(cumulative, torch.tensor([rank], device=self.device)))
            bits = torch.tensor([start * FINE_BINS + first + value], dtype=torch.int32)
            median[s] = float(bits.view(torch.float32))
            exact[s] = True
        return median, exact


def dimension_summary(phi: torch.Tensor, mean_sq: float, top: int = TOP_DIMS) -> dict:
    """The decomposition's fields from phi (d,) and E[mu^2] (both means over tokens, float64)."""
    order = torch.argsort(phi.abs(), descending=True, stable=True)
    ranked = phi[order]
    share = ranked / mean_sq if mean_sq > 0 else torch.full_like(ranked, math.nan)
    cumulative = ranked.cumsum(dim=0)
    reached = (cumulative >= SHARE_TARGET * mean_sq).nonzero()
    return {
        "top_dims": [int(i) for i in order[:top]],
        "top_shares": [json_number(v) for v in share[:top]],
        "top1_share": json_number(share[:1].sum()),
        "top8_share": json_number(share[:8].sum()),
        "dims_for_90": int(reached[0, 0]) + 1 if mean_sq > 0 and len(reached) else None,
    }


def mean_sources_rows(
    sites: Sequence[ProbeSite],
    stats: MeanSourcesStatistics,
    *,
    model: str,
    norm: str,
    step: int | None,
    tokens_seen: int | None,
    replicates: int = 1000,
    seed: int = 0,
) -> list[dict]:
    """``mean_sources.jsonl``: per site one ``kind: "dimensions"`` row, then one ``kind: "position"`` row per
    bucket (an empty bucket, beyond the probe's windows, has count 0 and null statistics) and one for the
    document starts (``bucket: "doc_start"``, positions null; count 0 and null statistics and share where
    no document start was probed, as without a separator).

    With per-document sums (``stats.documents``), each dimensions row also has the headline shares' 95%
    percentile intervals over ``replicates`` bootstrap resamples of the documents (seeded by ``seed``):
    ``position0_share``, ``top8_share`` and ``massive_share`` (the dimensions chosen on all tokens) with
    ``_low``/``_high``; and, the same on every row of the step, the median of each share over the step's
    inputs (massive: over those with a massive dimension) as [median, low, high] from the same resamples
    (``inputs_median_*``): the interval of the median the pages quote. Null without documents."""
    energy = stats.buckets
    count, mean, std = energy.count.cpu(), energy.mean.cpu(), energy.std().cpu()
    low, high, quantiles = energy.min.cpu(), energy.max.cpu(), energy.quantiles().cpu()
    tokens, mean_sq, bucket_mean_sq = stats.count.cpu(), stats.mean_sq.cpu(), stats.bucket_mean_sq.cpu()
    medians, exact = stats.median_abs()
    medians = medians.cpu()
    names = [*bucket_names(), DOC_START]
    firsts = [*BUCKET_STARTS, None]
    lasts = [*(start - 1 for start in BUCKET_STARTS[1:]), None, None]
    rows: list[dict] = []
    dimension_rows: list[dict] = []
    unit_sums: list[tuple[np.ndarray, np.ndarray]] = []
    for s, site in enumerate(sites):
        keys = {"model": model, "norm": norm, "step": step, "tokens_seen": tokens_seen, "layer": site.layer,
                "site": site.site, "dim": site.dim}
        n = float(tokens[s])
        total = float(mean_sq[s]) / n if n else math.nan
        phi = stats.phi[s].cpu() / max(n, 1.0)
        max_abs = stats.max_abs[s].cpu()
        median = float(medians[s])
        massive = (max_abs > MASSIVE_RATIO * median).nonzero().flatten()  # none where the median is NaN
        massive = massive[torch.argsort(max_abs[massive], descending=True, stable=True)]
        row = {**keys, "kind": "dimensions", "count": int(n), "mean_sq": json_number(total)}
        row.update(dimension_summary(phi, total))
        row.update(
            median_abs=json_number(median),
            median_exact=bool(exact[s]),
            massive_ratio=MASSIVE_RATIO,
            massive_count=len(massive),
            massive_dims=[int(i) for i in massive[:MASSIVE_LISTED]],
            massive_max_abs=[json_number(max_abs[i]) for i in massive[:MASSIVE_LISTED]],
            massive_share=json_number(phi[massive].sum() / total) if n and total > 0 else None,
            position0_share=json_number(bucket_mean_sq[s, 0] / mean_sq[s]) if n else None,
        )
        rows.append(row)
        dimension_rows.append(row)
        if stats.units and n:  # per unit: the sum of mu^2 (the shares' denominator) and the shares' parts
            unit_phi = stats.unit_phi[s].cpu()
            unit_sums.append((stats.unit_mean_sq[s].cpu().numpy(), np.stack([
                stats.unit_first_sq[s].cpu().numpy(), unit_phi[:, row["top_dims"][:8]].sum(dim=1).numpy(),
                unit_phi[:, massive].sum(dim=1).numpy()], axis=1)))
        for b, name in enumerate(names):
            i = s * stats.slots + b
            in_bucket = int(count[i, FRACTION])
            # A position bucket's share is 0 where it has no token; the document starts' is unknown there.
            known = bool(n) and (in_bucket > 0 or name != DOC_START)
            row = {**keys, "kind": "position", "bucket": name, "first_position": firsts[b],
                   "last_position": lasts[b], "count": in_bucket,
                   "mean_sq_share": json_number(bucket_mean_sq[s, b] / mean_sq[s]) if known else None}
            row.update({"mean": json_number(mean[i, FRACTION]), "std": json_number(std[i, FRACTION]),
                        "min": json_number(low[i, FRACTION]), "max": json_number(high[i, FRACTION])})
            row.update({q: json_number(quantiles[i, FRACTION, k]) for k, q in enumerate(QUANTILE_FIELDS)})
            if not in_bucket:
                row.update({field: None for field in ("mean", "std", "min", "max", *QUANTILE_FIELDS)})
            rows.append(row)
    if exact.numel() and not bool(exact[tokens > 0].all()):
        log.warning("%s: the median |x| of %d site(s) is the histogram's (within 1.6%%), not exact: it left "
                    "the band of values counted from the first batch", MEAN_SOURCES_FILE,
                    int((~exact[tokens > 0]).sum()))
    document_intervals(dimension_rows, unit_sums, stats.documents, replicates=replicates, seed=seed)
    return rows


SHARES = ("position0_share", "top8_share", "massive_share")  # the shares with intervals over documents


def document_intervals(dimension_rows: list[dict], unit_sums: list[tuple[np.ndarray, np.ndarray]],
                       documents: int, *, replicates: int, seed: int) -> None:
    """Add to ``dimension_rows`` the documents' bootstrap intervals of :data:`SHARES` (see
    :func:`mean_sources_rows`) from each row's per-unit sums ((U,) of mu^2, (U, 3) of the shares' parts):
    one draw of the units for every site (the same seed and U), so a median over the sites has replicates
    too."""
    known = len(unit_sums) == len(dimension_rows) > 0
    boots = []
    for row, (denominator, parts) in zip(dimension_rows, unit_sums if known else [], strict=False):
        interval = block_bootstrap_means(denominator, parts, replicates=replicates, block=1, seed=seed)
        for k, share in enumerate(SHARES):
            row[f"{share}_low"] = json_number(interval["low"][k])
            row[f"{share}_high"] = json_number(interval["high"][k])
        boots.append(interval["replicates"])
    massive = [i for i, row in enumerate(dimension_rows) if row["massive_count"]]
    for k, share in enumerate(SHARES):
        chosen = massive if share == "massive_share" else range(len(dimension_rows))
        median = None
        if known and chosen:
            values = np.median(np.stack([boots[i][:, k] for i in chosen], axis=1), axis=1)
            point = float(np.median([dimension_rows[i][share] for i in chosen]))
            median = [json_number(point), *(json_number(v) for v in np.quantile(values, [0.025, 0.975]))]
        for row in dimension_rows:
            row["documents"] = documents if known else None
            row.setdefault(f"{share}_low", None)
            row.setdefault(f"{share}_high", None)
            row[f"inputs_median_{share}"] = median


class MeanSourcesMeasurement(Measurement):
    """``mean_sources.jsonl``: where the component along 1 lives at every norm input."""

    def __init__(self, norms: Sequence[NormSite], device: torch.device | str = "cpu", *, documents: int = 0,
                 bootstrap_replicates: int = 1000, seed: int = 0) -> None:
        """``documents``: how many documents the probe stream holds (0: unknown; the batches'
        :attr:`ProbeBatch.documents` then go unused and the shares get no interval)."""
        self.norms = list(norms)
        self.stats = MeanSourcesStatistics([norm.dim for norm in self.norms], device=device,
                                           documents=documents)
        self.bootstrap = {"replicates": bootstrap_replicates, "seed": seed}

    def observe_norm(self, index: int, norm: NormSite, inputs: torch.Tensor, output: torch.Tensor,
                     batch: ProbeBatch) -> None:
        starts, documents = batch.document_starts, batch.documents
        with one_cpu_thread(self.stats.device):
            self.stats.update(index, inputs, None if starts is None else starts[: batch.rows],
                              None if documents is None else documents[: batch.rows])

    def all_reduce(self) -> None:
        self.stats.all_reduce()

    def records(self, where: RecordKeys) -> dict[str, list[dict]]:
        return {MEAN_SOURCES_FILE: mean_sources_rows(input_sites(self.norms), self.stats, **where,
                                                     **self.bootstrap)}
