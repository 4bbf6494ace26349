"""Streaming statistics of angles and norms: the one engine behind the training probe and ``analyze.py``.

For S sites and R reference vectors it keeps, per (site, reference): count, mean, M2 (Welford/Chan),
min, max and a fixed-bin histogram of the angle in degrees; per site: the count of zero vectors and
the moments of ||x||. Memory is O(S * R * bins), independent of how many tokens stream through, and
two instances (two batches, two ranks) merge exactly with Chan's parallel formula.

Null distribution: K further *null directions* (random unit vectors) get count, mean and M2 only
(no histogram), so :func:`null_comparison` can say where the reference 1 falls among random directions.

Uncertainty over text: with ``num_sequences`` > 0 it also keeps, per (site, probe sequence), the count
and the sum of (angle - 90 deg) for every direction and the sum of squares for the R references: O(S *
sequences * (R + K)) numbers, no activations. :func:`block_bootstrap` resamples whole sequences from
them, because tokens of one document are not independent draws.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from scipy import integrate
from scipy import stats as scipy_stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower
from statsmodels.stats.weightstats import DescrStatsW
from statsmodels.tools.sm_exceptions import ConvergenceWarning

from normgeo.measure.geometry import angle_deg, reads_back, unit_references

QUANTILES = (0.01, 0.05, 0.25, 0.50, 0.75, 0.95, 0.99)
QUANTILE_FIELDS = tuple(f"p{round(q * 100):02d}" for q in QUANTILES)
DEFAULT_BINS_PER_DEGREE = 40  # 0.025 deg bins: interpolated quantiles are within 0.025 deg
NULL_QUANTILES = (0.05, 0.50, 0.95)
# Per-sequence sums are of (angle - 90): the angles sit near 90, so sums of squares keep their digits.
CENTER_DEG = 90.0
# Near-axis (vector, null direction) pairs whose sine angle_deg refines, per vector on average over an
# update: a fixed buffer, so the GPU is not waited on for their number. In d dimensions a random direction is
# within 60 deg of a vector with probability ~exp(-d / 8); pairs beyond keep sqrt(1 - cos^2) (<= 0.03 deg).
NULL_NEAR_AXIS_PER_VECTOR = 1


def distributed() -> bool:
    """Whether this process is one of several in torch.distributed (else every all-reduce is a no-op)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def json_number(value: float) -> float | None:
    """JSON-safe float with 10 significant digits (NaN/inf, e.g. no samples, become null)."""
    value = float(value)
    return float(f"{value:.10g}") if math.isfinite(value) else None


def mean_t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None, float | None]:
    """Mean of ``values`` (e.g. per-seed differences of paired runs) and its two-sided Student-t interval.

    The interval is (None, None) for fewer than two values: one seed gives a difference, not an interval.
    """
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if x.size < 2:
        return mean, None, None
    half = float(scipy_stats.t.ppf(0.5 + level / 2, df=x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class PairedTest:
    """One paired contrast over seeds: the mean difference, its 95% and 90% Student-t intervals, the two-sided
    t-test against a zero difference and the two one-sided tests (TOST) of equivalence within ±margin.
    Intervals and p-values are None below two seeds."""

    n: int
    mean: float
    margin: float
    ci95: tuple[float, float] | None
    ci90: tuple[float, float] | None
    p_diff: float | None
    p_tost: float | None


def paired_test(values: Sequence[float], margin: float, alpha: float = 0.05) -> PairedTest:
    """The tests of per-seed differences ``values`` (arm - other) against 0 and against ±``margin``.

    TOST at level ``alpha`` rejects "|true difference| >= margin" exactly when the (1 - 2 alpha) interval
    (90% at alpha = 0.05) lies inside ±margin; its p-value is the larger of the two one-sided p-values
    (statsmodels' ``ttost_mean``). The difference test is the one-sample t-test of the differences.
    """
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean()) if x.size else math.nan
    if x.size < 2:
        return PairedTest(int(x.size), mean, margin, None, None, None, None)
    described = DescrStatsW(x)
    ci95 = tuple(float(v) for v in described.tconfint_mean(alpha))
    ci90 = tuple(float(v) for v in described.tconfint_mean(2 * alpha))
    if float(x.std(ddof=1)) == 0.0:  # identical differences: the t statistics are infinite
        p_diff = 0.0 if mean != 0 else 1.0
        p_tost = 0.0 if abs(mean) < margin else 1.0
    else:
        p_diff = float(described.ttest_mean(0.0)[1])
        p_tost = float(described.ttost_mean(-margin, margin)[0])
    return PairedTest(int(x.size), mean, margin, ci95, ci90, p_diff, p_tost)


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm-adjusted p-values of one family (statsmodels' ``multipletests``); None stays None (no test)."""
    tested = [i for i, p in enumerate(pvalues) if p is not None and not math.isnan(p)]
    adjusted: list[float | None] = [None] * len(pvalues)
    if tested:
        # statsmodels' Holm branch ends with gc.collect(): a full pass over a heap that holds torch and pandas
        # (~0.5 s a call). Objects frozen before the call are skipped by it, and unfrozen right after.
        gc.freeze()
        try:
            corrected = multipletests([pvalues[i] for i in tested], method="holm")[1]
        finally:
            gc.unfreeze()
        for i, p in zip(tested, corrected, strict=True):
            adjusted[i] = float(p)
    return adjusted


def seeds_for_difference(sd: float, margin: float, power: float = 0.8, alpha: float = 0.05,
                         most: int = 100_000) -> int:
    """Seeds (pairs) for a two-sided paired t-test at ``alpha`` to detect a true difference of ``margin``
    with probability ``power``, for paired differences of standard deviation ``sd`` (statsmodels)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a tiny effect: its root finder gives up (nan)
        n = float(np.asarray(TTestPower().solve_power(effect_size=margin / sd, alpha=alpha, power=power,
                                                      alternative="two-sided")).item())
    if math.isfinite(n) and n > most:
        raise ValueError(f"more than {most} seeds to detect {margin} at SD {sd}")
    if math.isfinite(n):
        return max(2, math.ceil(n - 1e-9))
    return fewest_seeds(lambda k: difference_power(k, sd, margin, alpha) >= power, most,
                        f"more than {most} seeds to detect {margin} at SD {sd}")


def fewest_seeds(enough: Callable[[int], bool], most: int, too_many: str) -> int:
    """The smallest n >= 2 that is ``enough`` (which only ever turns true as n grows): doubling, then
    bisection; ValueError ``too_many`` past ``most``."""
    low, high = 2, 2
    while not enough(high):
        low, high = high + 1, high * 2
        if high > most:
            raise ValueError(too_many)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle + 1, high)
    return high


def difference_power(n: int, sd: float, margin: float, alpha: float = 0.05) -> float:
    """Probability that the two-sided paired t-test at ``alpha`` rejects a zero difference with ``n`` seeds
    when the true difference is ``margin`` and the paired differences have standard deviation ``sd``
    (statsmodels; the power function :func:`seeds_for_difference` inverts)."""
    if n < 2:
        return 0.0
    power = TTestPower().power(effect_size=margin / sd, nobs=n, alpha=alpha, alternative="two-sided")
    return float(np.asarray(power).item())


def tost_power(n: int, sd: float, margin: float, true_difference: float = 0.0, alpha: float = 0.05) -> float:
    """Probability that TOST at ``alpha`` shows equivalence within ±``margin`` with ``n`` paired seeds.

    Exact for normal differences: TOST succeeds when |mean - 0| + t_crit * s / sqrt(n) < margin, the
    mean is N(true_difference, sd^2 / n) and independent of s, with (n - 1) s^2 / sd^2 ~ chi2(n - 1); the
    probability over the mean is integrated over the distribution of s (what Owen's Q function computes).
    """
    if n < 2:
        return 0.0
    df = n - 1
    se = sd / math.sqrt(n)
    t_crit = float(scipy_stats.t.ppf(1 - alpha, df))

    def given_chi2(q: float) -> float:
        half = margin - t_crit * sd * math.sqrt(q / df) / math.sqrt(n)  # the mean must lie within ±half
        if half <= 0:
            return 0.0
        inside = (scipy_stats.norm.cdf((half - true_difference) / se)
                  - scipy_stats.norm.cdf((-half - true_difference) / se))
        return float(inside * scipy_stats.chi2.pdf(q, df))

    # The integrand is 0 once t_crit * s / sqrt(n) >= margin: integrate up to that chi-square value.
    upper = df * (margin * math.sqrt(n) / (t_crit * sd)) ** 2
    value, _ = integrate.quad(given_chi2, 0.0, upper, limit=200)
    return float(min(max(value, 0.0), 1.0))


def seeds_for_equivalence(sd: float, margin: float, power: float = 0.8, alpha: float = 0.05,
                          true_difference: float = 0.0, most: int = 100_000) -> int:
    """The fewest seeds (pairs) with which TOST at ``alpha`` shows equivalence within ±``margin`` with
    probability ``power`` when the true difference is ``true_difference`` (default: none)."""
    if abs(true_difference) >= margin:
        raise ValueError(f"true difference {true_difference} is not inside the margin ±{margin}")
    return fewest_seeds(lambda n: tost_power(n, sd, margin, true_difference, alpha) >= power, most,
                        f"more than {most} seeds for ±{margin} at SD {sd}")


def smallest_decidable_margin(n: int, sd: float, power: float = 0.8, alpha: float = 0.05) -> float:
    """The narrowest margin within which TOST at ``alpha`` with ``n`` paired seeds shows
    equivalence with probability ``power`` when the true difference is 0: :func:`tost_power`
    inverted over the margin (bisection; the margin a study of ``n`` seeds can decide, where
    :func:`seeds_for_equivalence` gives the seeds a margin needs)."""
    if n < 2 or not (sd > 0 and math.isfinite(sd)):
        raise ValueError(f"a margin needs at least 2 seeds and a positive SD (n={n}, sd={sd})")
    low, high = 0.0, sd
    while tost_power(n, sd, high, 0.0, alpha) < power:
        low, high = high, high * 2
    for _ in range(50):
        middle = (low + high) / 2
        if tost_power(n, sd, middle, 0.0, alpha) >= power:
            high = middle
        else:
            low = middle
    return high


def chan_merge(
    count_a: torch.Tensor, mean_a: torch.Tensor, m2_a: torch.Tensor,
    count_b: torch.Tensor | float, mean_b: torch.Tensor, m2_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine (count, mean, M2) of two disjoint samples (Chan, Golub & LeVeque 1979). ``count_b`` may be a
    Python number: a count the host knows needs no copy to the device."""
    total = count_a + count_b
    safe = total.clamp(min=1)
    delta = mean_b - mean_a
    mean = mean_a + delta * count_b / safe
    m2 = m2_a + m2_b + delta.square() * count_a * count_b / safe
    return total, mean, m2


def add_counts(hist: torch.Tensor, bins: torch.Tensor, counted: torch.Tensor | None = None) -> None:
    """Add to the integer histogram ``hist`` (1-d) one count at each entry of ``bins`` (where ``counted``, a
    bool of the same shape, is true).

    On the CPU one ``bincount`` of the counted entries (an ``index_add_`` of int64 ones costs several times
    more there), or an ``index_add_`` of a few entries into many bins; on a GPU an ``index_add_``:
    ``bincount`` and a selection read a size back to the host.
    The counts are the same either way.
    """
    if reads_back(hist.device):
        flat = bins.reshape(-1) if counted is None else counted_entries(bins, counted)
        if 4 * flat.numel() < hist.numel():  # a few entries into many bins: no pass over all the bins
            hist.index_add_(0, flat, torch.ones(1, dtype=hist.dtype).expand(flat.numel()))
        else:
            hist += torch.bincount(flat, minlength=hist.numel())
        return
    ones = (torch.ones(1, dtype=hist.dtype, device=hist.device).expand(bins.numel()) if counted is None
            else counted.expand_as(bins).reshape(-1).to(hist.dtype))
    hist.index_add_(0, bins.reshape(-1).long(), ones)


def counted_entries(values: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """The entries of the CPU tensor ``values`` where ``counted`` (bool, broadcast to its shape) is true, in
    row-major order: ``torch.masked_select``'s, by numpy's selection (a third of its time on the CPU)."""
    entries = values.detach().numpy()
    return torch.from_numpy(entries[np.broadcast_to(counted.numpy(), entries.shape)])


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run the engine's many small CPU ops on one thread.

    Each op is too small to gain from intra-op threads, and on a busy machine every op's thread
    barrier can wait milliseconds for a descheduled thread (measured: 26 updates of 4096 tokens, d=512,
    K=64 took 1.27 s on 2 threads, 0.11 s on 1). The model's own forward keeps its threads.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def histogram_position(hist: torch.Tensor, quantiles: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., Q) where each quantile falls in the histograms ``hist`` (..., bins), in bins (the bin's index
    plus the linearly interpolated fraction of it), and each histogram's total (..., 1)."""
    hist = hist.to(torch.float64)
    cumulative = hist.cumsum(dim=-1)
    total = cumulative[..., -1:]
    targets = torch.tensor(quantiles, dtype=torch.float64, device=hist.device) * total
    index = torch.searchsorted(cumulative.contiguous(), targets.contiguous()).clamp(max=hist.shape[-1] - 1)
    below = torch.where(index > 0, cumulative.gather(-1, (index - 1).clamp(min=0)), torch.zeros_like(targets))
    fraction = ((targets - below) / hist.gather(-1, index).clamp(min=1)).clamp(0, 1)
    return index.to(torch.float64) + fraction, total


class AngleStatistics:
    """Angles (degrees) of token vectors with reference vectors, and their norms, at S sites."""

    def __init__(
        self,
        num_sites: int,
        references: torch.Tensor,
        bins_per_degree: int = DEFAULT_BINS_PER_DEGREE,
        device: torch.device | str = "cpu",
        null_directions: torch.Tensor | None = None,
        num_sequences: int = 0,
        sites_per_pass: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        # How many sites :meth:`update_sites` takes in one pass (None: all on a GPU, one on the CPU).
        self.sites_per_pass = sites_per_pass
        self.num_sites = num_sites
        self.bins_per_degree = bins_per_degree
        self.num_bins = 180 * bins_per_degree
        refs = references.to(self.device, torch.float32)
        self.num_refs = refs.shape[0]
        nulls = (
            torch.zeros((0, refs.shape[1]), dtype=torch.float32, device=self.device)
            if null_directions is None
            else null_directions.to(self.device, torch.float32)
        )
        self.num_null = nulls.shape[0]
        # Made ready for angle_deg once (the same bits it would make at every update): fewer kernels a pass.
        self.ref_units = unit_references(refs, torch.float32, self.device)
        self.null_units = unit_references(nulls, torch.float32, self.device)
        shape = (num_sites, self.num_refs)
        f64 = {"dtype": torch.float64, "device": self.device}
        null_shape = (num_sites, self.num_null)
        self.null_count = torch.zeros(null_shape, **f64)
        self.null_mean = torch.zeros(null_shape, **f64)
        self.null_m2 = torch.zeros(null_shape, **f64)
        self.num_sequences = num_sequences
        directions = self.num_refs + self.num_null
        self.seq_count = torch.zeros((num_sites, num_sequences), **f64)
        self.seq_sum = torch.zeros((num_sites, num_sequences, directions), **f64)
        self.seq_sumsq = torch.zeros((num_sites, num_sequences, self.num_refs), **f64)
        self.count = torch.zeros(shape, **f64)
        self.mean = torch.zeros(shape, **f64)
        self.m2 = torch.zeros(shape, **f64)
        self.min = torch.full(shape, math.inf, **f64)
        self.max = torch.full(shape, -math.inf, **f64)
        self.hist = torch.zeros((*shape, self.num_bins), dtype=torch.int64, device=self.device)
        # Where each (site, reference)'s histogram starts in the flattened histograms of consecutive sites.
        self.bin_offsets = (torch.arange(num_sites * self.num_refs, device=self.device) * self.num_bins).view(
            num_sites, 1, self.num_refs)
        self.zero_count = torch.zeros(num_sites, **f64)
        self.norm_count = torch.zeros(num_sites, **f64)
        self.norm_mean = torch.zeros(num_sites, **f64)
        self.norm_m2 = torch.zeros(num_sites, **f64)

    @torch.no_grad()
    def update(self, site: int, vectors: torch.Tensor, sequence_ids: torch.Tensor | None = None) -> None:
        """Add every vector of ``vectors`` (..., d) at ``site``; bf16/fp16 inputs are cast up first.

        ``sequence_ids`` (only with ``num_sequences``): the probe-sequence index of each row of a
        ``(rows, T, d)`` tensor, for the per-sequence sums.
        """
        self.update_sites(site, [vectors], sequence_ids)

    @torch.no_grad()
    def update_sites(self, first_site: int, vectors: Sequence[torch.Tensor],
                     sequence_ids: torch.Tensor | None = None,
                     rms_standardized: tuple[int, float] | None = None) -> None:
        """:meth:`update` of S consecutive sites at once: ``vectors[i]`` (..., d) is site ``first_site + i``,
        the same rows at each (a norm's input, standardized input and output). ``rms_standardized`` (i,
        eps): site ``first_site + i`` is not in ``vectors`` (those from ``vectors[i]`` on are the sites after
        it): it is ``vectors[i - 1]`` standardized by RMSNorm, ``x / sqrt(mean(x^2) + eps)``, a positive
        multiple, so its angles are theirs and its norms ``sqrt(d) ||x|| / sqrt(||x||^2 + d eps)`` follow
        from theirs; it is never made.

        On a GPU the S sites go in one pass, which launches about a third of the kernels that three passes
        would, and the host never waits on the GPU: counts stay tensors, the histogram is an ``index_add_``
        (:func:`add_counts`), zero vectors are masked rather than branched on, ``angle_deg``
        picks its near-axis pairs into a buffer of fixed size, and ``sequence_ids`` should already be on the
        device (a copy from the host waits for the GPU; :class:`AngleMeasurement` copies them once a batch).
        On the CPU the angles are taken site by site: each site's vectors are then a view, where stacking
        the sites would copy them all (a pass more, into fresh pages), for no fewer operations that matter.
        """
        per_pass = self.sites_per_pass or (len(vectors) if self.device.type == "cuda" else 1)
        parts = [self._directions(vectors[start:start + per_pass])
                 for start in range(0, len(vectors), per_pass)]
        with one_cpu_thread(self.device):
            norms, ref_degrees, null_degrees = (torch.cat(p) if len(p) > 1 and p[0] is not None else p[0]
                                                for p in zip(*parts, strict=True))
            take = None
            if rms_standardized is not None:
                index, eps = rms_standardized
                take = [*range(index), index - 1, *range(index, len(vectors))]
                ref_degrees = ref_degrees[take]
                length, dim = norms[index - 1 : index].double(), vectors[0].shape[-1]
                own = (math.sqrt(dim) * length / (length.square() + dim * eps).sqrt()).to(norms.dtype)
                norms = torch.cat([norms[:index], own, norms[index:]])
            self._update(slice(first_site, first_site + len(vectors) + (rms_standardized is not None)),
                         norms, ref_degrees, null_degrees, sequence_ids, take)

    def _directions(self, vectors: Sequence[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(norms (S, n), angles with the references (S, n, R), with the null directions (S, n, K) or None)
        of S sites' vectors, by the package's one formula (geometry.angle_deg: atan2, accurate near 0 and
        180 deg); a zero vector's angles are NaN."""
        # (S, n, d) in float32 (bf16/fp16 cast up); one site is a view, several are stacked into one tensor.
        rows = [v.detach().reshape(1, -1, v.shape[-1]).to(torch.float32) for v in vectors]
        x = rows[0] if len(rows) == 1 else torch.cat(rows)
        # In float32, the moments summed in float64: within 2e-5 deg near 0, 90 and 180 (tests/test_stats.py).
        # The references' product apart from the null directions': their angles are the same bits whatever K.
        # Every near-axis reference pair refined, and up to NULL_NEAR_AXIS_PER_VECTOR per vector of the null
        # directions' (a random direction is rarely near one). With the caller's threads: the null product,
        # (n x d) by (d x K), is the one op of the statistics large enough to gain from them.
        norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        vectors = x.shape[0] * x.shape[1]
        ref = angle_deg(x, self.ref_units, self.num_refs * vectors, x_norm=norms)
        null = (angle_deg(x, self.null_units, NULL_NEAR_AXIS_PER_VECTOR * vectors, x_norm=norms)
                if self.num_null else None)
        return norms.squeeze(-1), ref.double(), null

    def _update(self, sites: slice, norms: torch.Tensor, ref_degrees: torch.Tensor,
                null_degrees: torch.Tensor | None, sequence_ids: torch.Tensor | None,
                take: list[int] | None = None) -> None:
        """Add the S ``sites``' norms (S, n), reference angles (S, n, R) and null angles, which this update
        owns (it writes into them): (S, n, K), or with ``take`` one site per distinct one, ``take[i]`` being
        site i's (an RMSNorm's standardized input repeats its input's angles: their sums are repeated, not
        the (n, K) angles)."""
        S = norms.shape[0]
        self._update_norms(sites, norms.to(torch.float64))
        nonzero = norms > 0
        count = nonzero.sum(dim=1, dtype=torch.float64).unsqueeze(1)  # (S, 1): the vectors with a direction
        self.zero_count[sites] += norms.shape[1] - count.squeeze(1)
        safe_count = count.clamp(min=1)  # a site of zero vectors only adds nothing
        per_sequence = sequence_ids is not None and self.num_sequences > 0
        groups = len(sequence_ids) if per_sequence else 1  # rows summed together: one per sequence
        R = self.num_refs
        # A zero vector has no angle: it is set to 90 deg here (0 once centered), out of every sum.
        directed = nonzero.unsqueeze(-1)  # (S, n, 1)
        ref_degrees = torch.where(directed, ref_degrees, CENTER_DEG)  # (S, n, R)
        batch_mean = torch.where(directed, ref_degrees, 0.0).sum(dim=1) / safe_count
        batch_m2 = torch.where(directed, ref_degrees - batch_mean.unsqueeze(1), 0.0).square().sum(dim=1)
        self.count[sites], self.mean[sites], self.m2[sites] = chan_merge(
            self.count[sites], self.mean[sites], self.m2[sites], count, batch_mean, batch_m2
        )
        self.min[sites] = torch.minimum(
            self.min[sites], torch.where(directed, ref_degrees, math.inf).amin(dim=1)
        )
        self.max[sites] = torch.maximum(
            self.max[sites], torch.where(directed, ref_degrees, -math.inf).amax(dim=1)
        )
        bins = (ref_degrees * self.bins_per_degree).long().clamp_(0, self.num_bins - 1)
        add_counts(self.hist[sites].view(-1), bins + self.bin_offsets[:S], directed)

        # Null directions: sums of (angle - 90), over a sequence (or a batch) in float32 and on in float64:
        # random directions in high dimension stay within a few degrees of 90, so the sums of squares lose
        # no digits to cancellation. In place: a copy of the (S, n, K) angles (a float64 one, or an RMSNorm's
        # repeated site) was the largest single cost of the angles.
        if null_degrees is not None:
            distinct = directed if take is None else directed[[take.index(j) for j in range(max(take) + 1)]]
            centered = null_degrees.sub_(CENTER_DEG).masked_fill_(~distinct, 0.0)  # zero vector: 0
            centered = centered.view(len(distinct), groups, -1, self.num_null)
            null_sum = centered.sum(dim=2).double()  # (S, groups, K)
            null_sumsq = centered.square_().sum(dim=2).double()
            if take is not None:
                null_sum, null_sumsq = null_sum[take], null_sumsq[take]
            total, square = null_sum.sum(dim=1), null_sumsq.sum(dim=1)
            null_mean = CENTER_DEG + total / safe_count
            null_m2 = (square - total.square() / safe_count).clamp(min=0)
            self.null_count[sites], self.null_mean[sites], self.null_m2[sites] = chan_merge(
                self.null_count[sites], self.null_mean[sites], self.null_m2[sites], count, null_mean, null_m2
            )
        if per_sequence:
            ids = sequence_ids.to(self.device)
            ref_centered = (ref_degrees - CENTER_DEG).view(S, groups, -1, R)  # zero vectors: 0
            sums = ref_centered.sum(dim=2)  # (S, groups, R)
            if null_degrees is not None:
                sums = torch.cat([sums, null_sum], dim=2)
            self.seq_count[sites].index_add_(
                1, ids, nonzero.view(S, groups, -1).sum(dim=2, dtype=torch.float64)
            )
            self.seq_sum[sites].index_add_(1, ids, sums)
            self.seq_sumsq[sites].index_add_(1, ids, ref_centered.square().sum(dim=2))

    def _update_norms(self, sites: slice, norms: torch.Tensor) -> None:
        batch_mean = norms.mean(dim=1)
        batch_m2 = (norms - batch_mean.unsqueeze(1)).square().sum(dim=1)
        self.norm_count[sites], self.norm_mean[sites], self.norm_m2[sites] = chan_merge(
            self.norm_count[sites], self.norm_mean[sites], self.norm_m2[sites], float(norms.shape[1]),
            batch_mean, batch_m2
        )

    def merge(self, other: AngleStatistics) -> None:
        """Fold in statistics of a disjoint set of tokens (another batch, another rank).

        Per-sequence sums add: each sequence is measured by exactly one of the two (rows of the other
        are zero).
        """
        self._merge_moments(other)
        self.hist += other.hist
        self.seq_count += other.seq_count
        self.seq_sum += other.seq_sum
        self.seq_sumsq += other.seq_sumsq

    def _merge_moments(self, other: AngleStatistics) -> None:
        self.count, self.mean, self.m2 = chan_merge(
            self.count, self.mean, self.m2, other.count, other.mean, other.m2
        )
        self.null_count, self.null_mean, self.null_m2 = chan_merge(
            self.null_count, self.null_mean, self.null_m2, other.null_count, other.null_mean, other.null_m2
        )
        self.min = torch.minimum(self.min, other.min)
        self.max = torch.maximum(self.max, other.max)
        self.zero_count += other.zero_count
        self.norm_count, self.norm_mean, self.norm_m2 = chan_merge(
            self.norm_count, self.norm_mean, self.norm_m2, other.norm_count, other.norm_mean, other.norm_m2
        )

    _MOMENT_FIELDS = (
        "count", "mean", "m2", "min", "max", "zero_count", "norm_count", "norm_mean", "norm_m2",
        "null_count", "null_mean", "null_m2",
    )
    _SUMMED_FIELDS = ("hist", "seq_count", "seq_sum", "seq_sumsq")

    def all_reduce(self) -> None:
        """Merge the statistics of every rank into every rank (no-op outside torch.distributed).

        Moments (of the references and the null directions) are gathered and merged in rank order with
        Chan's formula, so all ranks hold the same numbers, equal to a single process's up to float
        rounding; histograms and per-sequence sums (each sequence lives on one rank) are summed exactly.
        """
        if not distributed():
            return
        packed = torch.cat([getattr(self, f).reshape(-1) for f in self._MOMENT_FIELDS])
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, packed)
        for field in self._SUMMED_FIELDS:
            dist.all_reduce(getattr(self, field))
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
                merged._merge_moments(part)
        assert merged is not None
        for field in self._MOMENT_FIELDS:
            setattr(self, field, getattr(merged, field))

    def _empty_like(self) -> AngleStatistics:
        empty = AngleStatistics.__new__(AngleStatistics)
        empty.__dict__.update(self.__dict__)
        for field in self._MOMENT_FIELDS:
            setattr(empty, field, torch.zeros_like(getattr(self, field)))
        for field in self._SUMMED_FIELDS:  # reduced separately
            setattr(empty, field, torch.zeros(0, dtype=getattr(self, field).dtype))
        return empty

    def std(self) -> torch.Tensor:
        """Population standard deviation of the angles, (S, R)."""
        return (self.m2 / self.count.clamp(min=1)).sqrt()

    def null_std(self) -> torch.Tensor:
        """Population standard deviation of the angles with each null direction, (S, K)."""
        return (self.null_m2 / self.null_count.clamp(min=1)).sqrt()

    def norm_std(self) -> torch.Tensor:
        return (self.norm_m2 / self.norm_count.clamp(min=1)).sqrt()

    def quantiles(self, quantiles: Sequence[float] = QUANTILES) -> torch.Tensor:
        """Quantiles (S, R, Q) in degrees, linearly interpolated inside the histogram bins.

        The error is at most one bin width (1 / bins_per_degree degrees); the result is clamped into
        the exact [min, max] so a narrow distribution is not widened to the bin edges.
        """
        position, total = histogram_position(self.hist, quantiles)
        degrees = position / self.bins_per_degree
        degrees = torch.maximum(torch.minimum(degrees, self.max.unsqueeze(-1)), self.min.unsqueeze(-1))
        return torch.where(total > 0, degrees, torch.full_like(degrees, math.nan))


def _rank_percent(value: torch.Tensor, null: torch.Tensor) -> torch.Tensor:
    """Percentile rank of ``value`` (S,) among ``null`` (S, K): 100 (#below + #equal / 2) / K."""
    below = (null < value.unsqueeze(1)).sum(dim=1).to(torch.float64)
    equal = (null == value.unsqueeze(1)).sum(dim=1).to(torch.float64)
    return 100.0 * (below + 0.5 * equal) / null.shape[1]


def _z_score(value: torch.Tensor, null: torch.Tensor) -> torch.Tensor:
    """(value - mean of the null values) / their sample standard deviation (ddof 1)."""
    return (value - null.mean(dim=1)) / null.std(dim=1, correction=1)


def null_comparison(stats: AngleStatistics, ref: int = 0) -> dict[str, torch.Tensor]:
    """Where reference ``ref`` (the uniform vector 1 in the probe) stands among the K null directions.

    Per site, for the mean angle and for its standard deviation (the spread over tokens):
    ``*_null_p05/p50/p95``: quantiles of the K null directions' values (linear interpolation between
    order statistics, numpy's default); ``*_rank``: percentile rank of the reference's value among them;
    ``*_z``: its z-score against them. Each entry is a CPU float64 tensor of shape (S,) ((S, 3) for the
    quantiles, and (S, K) for ``null_means``/``null_stds``).
    """
    if stats.num_null < 2:
        raise ValueError("null_comparison needs at least 2 null directions")
    q = torch.tensor(NULL_QUANTILES, dtype=torch.float64)
    result: dict[str, torch.Tensor] = {}
    for name, value, null in (
        ("mean", stats.mean[:, ref].cpu(), stats.null_mean.cpu()),
        ("std", stats.std()[:, ref].cpu(), stats.null_std().cpu()),
    ):
        result[name] = value
        result[f"{name}_null_q"] = torch.quantile(null, q, dim=1).T  # (S, 3)
        result[f"{name}_rank"] = _rank_percent(value, null)
        result[f"{name}_z"] = _z_score(value, null)
        result[f"null_{name}s"] = null
    return result


@functools.lru_cache(maxsize=8)
def block_weights(sequences: int, *, replicates: int, block: int, seed: int) -> tuple[int, np.ndarray]:
    """(number of blocks, (replicates, blocks) resampling weights, read-only): the one block-bootstrap draw.

    Blocks of ``block`` consecutive probe sequences (a document longer than a sequence continues in the
    next) are drawn with replacement, as many as there are blocks. Every interval over probe sequences
    (``null.jsonl``'s, ``intervention.jsonl``'s) uses this draw: the same ``seed`` and number of sequences
    give the same resamples. Drawn once per arguments (cached): every site of a probe asks for the same.
    """
    blocks = -(-sequences // block)
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(blocks, np.full(blocks, 1.0 / blocks), size=replicates).astype(np.float64)
    weights.flags.writeable = False
    return blocks, weights


def block_totals(per_sequence: np.ndarray, block: int, axis: int) -> np.ndarray:
    """Sum ``per_sequence`` over blocks of ``block`` consecutive sequences along ``axis`` (the last block
    padded with zeros)."""
    values = np.moveaxis(per_sequence, axis, 0)
    pad = -len(values) % block
    values = np.pad(values, [(0, pad)] + [(0, 0)] * (values.ndim - 1))
    totals = values.reshape(-1, block, *values.shape[1:]).sum(axis=1)
    return np.moveaxis(totals, 0, axis)


def block_bootstrap_means(
    seq_count: np.ndarray,
    seq_sum: np.ndarray,
    *,
    replicates: int = 1000,
    block: int = 1,
    seed: int = 0,
    level: float = 0.95,
    drop_empty: bool = False,
) -> dict[str, np.ndarray]:
    """Token-weighted means of M per-token quantities and their percentile block-bootstrap intervals.

    ``seq_count`` (N,) holds each probe sequence's number of tokens and ``seq_sum`` (N, M) the sums of the
    M quantities over them; a replicate's mean is its total sum over its total count (like the point
    estimate). Returns ``mean``, ``low`` and ``high``, each (M,); NaN where no token was counted; and
    ``replicates`` (B, M), the replicates' means, for a statistic of several such means (the same ``seed``
    and number of sequences draw the same resamples, so two calls' replicates are paired).
    ``drop_empty``: the interval is over the replicates that drew a token (tokens that only some sequences
    hold, such as the first tokens of documents); otherwise one replicate without any makes it NaN.
    """
    if len(seq_count) == 0:
        raise ValueError("block_bootstrap_means needs per-sequence sums of at least one sequence")
    _, weights = block_weights(len(seq_count), replicates=replicates, block=block, seed=seed)
    counts = block_totals(np.asarray(seq_count, dtype=np.float64), block, axis=0)
    sums = block_totals(np.asarray(seq_sum, dtype=np.float64), block, axis=0)
    alpha = (1.0 - level) / 2.0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums.sum(axis=0) / counts.sum()
        drawn = weights @ counts
        boot = (weights @ sums) / drawn[:, None]  # (B, M)
        if drop_empty and (drawn > 0).any():
            boot = boot[drawn > 0]
        low, high = np.quantile(boot, [alpha, 1 - alpha], axis=0)
    return {"mean": mean, "low": low, "high": high, "replicates": boot}


def block_bootstrap(
    seq_count: np.ndarray,
    seq_sum: np.ndarray,
    *,
    ref: int = 0,
    null: slice | None = None,
    replicates: int = 1000,
    block: int = 1,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, np.ndarray]:
    """Percentile block-bootstrap intervals over probe sequences, from per-sequence sufficient statistics.

    ``seq_count`` (S, N) and ``seq_sum`` (S, N, D) hold, per site and sequence, the number of token
    vectors and the sum of (angle - 90 deg) with each direction; the draw is :func:`block_weights`'s and a
    replicate's mean is token-weighted, like the point estimate. Returns per site (S,) arrays: ``mean`` and
    ``mean_low``/``mean_high`` for reference ``ref``; with ``null`` (the null directions' columns), ``diff``
    = mean - median of the null directions' means and ``diff_low``/``diff_high``.
    """
    sites, sequences = seq_count.shape
    if sequences == 0:
        raise ValueError("block_bootstrap needs per-sequence statistics (num_sequences > 0)")
    _, weights = block_weights(sequences, replicates=replicates, block=block, seed=seed)  # (B, nb)
    counts = block_totals(seq_count, block, axis=1)
    sums = block_totals(seq_sum, block, axis=1)
    alpha = (1.0 - level) / 2.0
    with np.errstate(invalid="ignore", divide="ignore"):
        total = counts.sum(axis=1)
        mean = CENTER_DEG + sums[:, :, ref].sum(axis=1) / total
        boot_counts = weights @ counts.T  # (B, S)
        boot_mean = CENTER_DEG + (weights @ sums[:, :, ref].T) / boot_counts
        result = {"mean": mean}
        result["mean_low"], result["mean_high"] = np.quantile(boot_mean, [alpha, 1 - alpha], axis=0)
        if null is not None:
            null_means = CENTER_DEG + sums[:, :, null].sum(axis=1) / total[:, None]  # (S, K)
            result["diff"] = mean - np.median(null_means, axis=1)
            diffs = np.empty((replicates, sites))
            for s in range(sites):  # (B, nb) @ (nb, K) per site keeps memory at B x K
                boot_null = CENTER_DEG + (weights @ sums[s, :, null]) / boot_counts[:, s : s + 1]
                diffs[:, s] = boot_mean[:, s] - np.median(boot_null, axis=1)
            result["diff_low"], result["diff_high"] = np.quantile(diffs, [alpha, 1 - alpha], axis=0)
    return result
