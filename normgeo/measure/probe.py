"""The angle probe: forward hooks on every norm feed each token vector into :class:`AngleStatistics`.

Used as is by the training callback (our GPT at each checkpoint step) and by ``analyze.py`` (any
Hugging Face model). Nothing is stored but the statistics: a hook reduces its tensor and lets it go.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from normgeo.measure.energy import EnergyStatistics
from normgeo.measure.geometry import STANDARDIZABLE_KINDS, standardize
from normgeo.measure.norm_sites import NormSite, find_norm_sites
from normgeo.measure.stats import AngleStatistics, one_cpu_thread

REFERENCE_NAMES = ("ones", "rand_a", "rand_b")
NULL_KEY = "null"  # the (K, d) null directions in the references dict and probe_references.npz
DEFAULT_NULL_DIRECTIONS = 64
# rand_b is stored with norm 3 sqrt(d) only to match the paper's "random vector of another norm": the
# engine normalizes every reference and angles are scale-invariant, so rand_b is just a second random
# direction. It is kept for comparison with the paper's figures.
RAND_B_NORM_RATIO = 3.0
# The one default for the .std sites (the norm without its gain and bias: LayerNorm's puts every token at
# exactly 90 deg from 1), for the training probe and analyze.py alike (conf/shared/probe/pydoc.yaml says the same).
INCLUDE_STANDARDIZED = True


def make_references(dim: int, seed: int = 1234, null_directions: int = DEFAULT_NULL_DIRECTIONS) -> dict[str, np.ndarray]:
    """The uniform vector 1, two random directions and ``null_directions`` more, from a model-independent seed.

    ``rand_a`` has the norm of 1 (sqrt(d)), ``rand_b`` 3 sqrt(d) (the paper's "other norm"; no angle
    depends on it). ``null`` is a (K, d) array of unit vectors uniform on the sphere (normalized
    Gaussians): the null distribution that 1 is compared with. Everything depends only on (seed, d),
    so both arms and every checkpoint of an experiment share them; the null directions come from their
    own stream, so rand_a and rand_b are the same whatever K is.
    """
    rng = np.random.default_rng([seed, dim])
    ones = np.ones(dim)
    rand_a = rng.standard_normal(dim)
    rand_a *= math.sqrt(dim) / np.linalg.norm(rand_a)
    rand_b = rng.standard_normal(dim)
    rand_b *= RAND_B_NORM_RATIO * math.sqrt(dim) / np.linalg.norm(rand_b)
    references = {"ones": ones, "rand_a": rand_a, "rand_b": rand_b}
    if null_directions:
        null = np.random.default_rng([seed, dim, 1]).standard_normal((null_directions, dim))
        references[NULL_KEY] = null / np.linalg.norm(null, axis=1, keepdims=True)
    return references


# on_batch(call, batch, output, rows, sequence_ids) of run_probe: after each forward (see run_probe).
BatchObserver = Callable[[Callable[[torch.Tensor], object], torch.Tensor, object, int, torch.Tensor], None]


@dataclass(frozen=True)
class ProbeSite:
    """One measured place: the input or output (or standardized input) of one norm module."""

    layer: int | str
    site: str  # e.g. "ln1.in", "final.out"
    kind: str
    dim: int


def probe_sites(norms: Sequence[NormSite], include_standardized: bool = INCLUDE_STANDARDIZED) -> list[ProbeSite]:
    sites = []
    for norm in norms:
        standardized = include_standardized and norm.kind in STANDARDIZABLE_KINDS
        suffixes = ("in", "std", "out") if standardized else ("in", "out")
        sites += [ProbeSite(norm.layer, f"{norm.role}.{suffix}", norm.kind, norm.dim) for suffix in suffixes]
    return sites


def input_sites(norms: Sequence[NormSite]) -> list[ProbeSite]:
    """The ``<role>.in`` site of every norm, in order: the sites of :class:`EnergyStatistics`."""
    return [ProbeSite(norm.layer, f"{norm.role}.in", norm.kind, norm.dim) for norm in norms]


def residual_norms(norms: Sequence[NormSite]) -> list[NormSite]:
    """The norms of the residual stream: those of the most common width (drops per-head q/k norms)."""
    widths = Counter(norm.dim for norm in norms)
    width = widths.most_common(1)[0][0]
    return [norm for norm in norms if norm.dim == width]


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def run_probe(
    model: nn.Module,
    sequences: torch.Tensor,
    references: dict[str, np.ndarray],
    *,
    forward: Callable[[torch.Tensor], object] | None = None,
    norms: Sequence[NormSite] | None = None,
    batch_size: int = 8,
    include_standardized: bool = INCLUDE_STANDARDIZED,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    device: torch.device | str | None = None,
    progress: bool = False,
    pad_to: int = 0,
    sequence_ids: torch.Tensor | None = None,
    num_sequences: int | None = None,
    energy: EnergyStatistics | None = None,
    on_batch: BatchObserver | None = None,
) -> tuple[list[ProbeSite], AngleStatistics]:
    """Stream ``sequences`` (n, T) of token ids through ``model`` and measure every norm's in/out vectors.

    ``forward`` defaults to ``model(batch)``; ``autocast`` gives the precision (e.g. the training
    precision's context). The statistics are *not* reduced across ranks: call ``all_reduce`` on them.
    ``pad_to``: run forward passes over at least that many sequences, padding with dummy rows that are
    never measured, so that every rank of a sharded model makes the same collective calls.
    ``references[NULL_KEY]``, if present, adds the null directions. Per-sequence sums are kept for
    ``num_sequences`` sequences (default: ``len(sequences)``; 0 turns them off), ``sequences[i]`` being
    number ``sequence_ids[i]`` (default ``i``): a rank or a part of the probe passes its global indices.
    ``energy``: also stream what mean subtraction removes at every norm input into it, site k being the
    k-th of ``residual_norms(norms)`` (see :func:`input_sites`).
    ``on_batch(call, batch, output, rows, sequence_ids)``: called after each forward with its output, the
    number of real (not padding) rows and their global indices, while the hooks measure nothing, so it
    may run more forwards through ``call`` (the centering intervention,
    :class:`normgeo.measure.intervention.InterventionProbe`).
    """
    norms = residual_norms(list(norms) if norms is not None else find_norm_sites(model))
    sites = probe_sites(norms, include_standardized)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    reference_matrix = torch.from_numpy(np.stack([references[name] for name in REFERENCE_NAMES]))
    null = references.get(NULL_KEY)
    measured = len(sequences)
    if sequence_ids is None:
        sequence_ids = torch.arange(measured)
    num_sequences = measured if num_sequences is None else num_sequences
    stats = AngleStatistics(
        len(sites),
        reference_matrix,
        device=device,
        null_directions=torch.from_numpy(null) if null is not None and len(null) else None,
        num_sequences=num_sequences,
    )
    site_index = {site: i for i, site in enumerate(sites)}
    energy_index = {norm.name: i for i, norm in enumerate(norms)}
    batch_ids = [sequence_ids[:0]]  # global indices of the measured rows of the current batch
    if pad_to > measured:
        sequences = torch.cat([sequences, sequences.new_zeros((pad_to - measured, sequences.shape[1]))])
    rows_to_measure = [0]  # of the current batch: the rows that are real probe sequences, not padding

    def make_hook(norm: NormSite):
        in_index = site_index[ProbeSite(norm.layer, f"{norm.role}.in", norm.kind, norm.dim)]
        out_index = site_index[ProbeSite(norm.layer, f"{norm.role}.out", norm.kind, norm.dim)]
        std_site = ProbeSite(norm.layer, f"{norm.role}.std", norm.kind, norm.dim)

        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            rows = rows_to_measure[0]
            if rows == 0:
                return
            hidden = inputs[0][:rows]
            ids = batch_ids[0]
            stats.update(in_index, hidden.to(device), ids)
            if energy is not None:
                with one_cpu_thread(energy.device):
                    energy.update(energy_index[norm.name], hidden)
            stats.update(out_index, (output[0] if isinstance(output, tuple) else output)[:rows].to(device), ids)
            if include_standardized and norm.kind in STANDARDIZABLE_KINDS:
                standardized = standardize(hidden.to(device).float(), norm.kind, norm.eps)
                stats.update(site_index[std_site], standardized, ids)

        return hook

    call = forward or (lambda batch: model(batch))
    handles = [norm.module.register_forward_hook(make_hook(norm)) for norm in norms]
    try:
        bar = tqdm(total=measured * sequences.shape[1], desc="probe", unit="tok", unit_scale=True, disable=not progress)
        with _eval_mode(model), torch.no_grad(), autocast(), bar:
            for start in range(0, len(sequences), batch_size):
                batch = sequences[start : start + batch_size]
                rows_to_measure[0] = max(0, min(len(batch), measured - start))
                batch_ids[0] = sequence_ids[start : start + rows_to_measure[0]]
                batch = batch.to(device, non_blocking=True)
                output = call(batch)
                if on_batch is not None:
                    rows = rows_to_measure[0]
                    rows_to_measure[0] = 0  # what on_batch runs is not measured by the angle hooks
                    on_batch(call, batch, output, rows, batch_ids[0])
                    rows_to_measure[0] = rows
                del output  # the logits of a batch can be GBs: gone before the next forward
                bar.update(rows_to_measure[0] * batch.shape[1])
    finally:
        for handle in handles:
            handle.remove()
    return sites, stats
