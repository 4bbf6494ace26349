"""What the probe measures against: the reference vectors,
the measured sites of each norm, the residual norms.

The probe loop itself is :func:`normgeo.measure.pipeline.run_probe`; the angle statistics are
:class:`normgeo.measure.angles.AngleMeasurement`'s.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from normgeo.measure.geometry import STANDARDIZABLE_KINDS
from normgeo.measure.norm_sites import NormSite

REFERENCE_NAMES = ("ones", "rand_a", "rand_b")
NULL_KEY = "null"  # the (K, d) null directions in the references dict and probe_references.npz
DEFAULT_NULL_DIRECTIONS = 64
DEFAULT_SEED = 1234  # the probe's: reference vectors, null directions, document sampling and bootstrap
# rand_b is stored with norm 3 sqrt(d) only to match the paper's "random vector of another norm": the
# engine normalizes every reference and angles are scale-invariant, so rand_b is just a second random
# direction. It is kept for comparison with the paper's figures.
RAND_B_NORM_RATIO = 3.0
# The one default for the .std sites (the norm without its gain and bias: LayerNorm's puts every token at
# exactly 90 deg from 1), for the training probe and analyze.py
# alike (conf/shared/probe/pydoc.yaml says the same).
INCLUDE_STANDARDIZED = True


def make_references(
    dim: int, seed: int = DEFAULT_SEED, null_directions: int = DEFAULT_NULL_DIRECTIONS
) -> dict[str, np.ndarray]:
    """The uniform vector 1, two random directions and
    ``null_directions`` more, from a model-independent seed.

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


@dataclass(frozen=True)
class ProbeSite:
    """One measured place: the input or output (or standardized input) of one norm module."""

    layer: int | str
    site: str  # e.g. "ln1.in", "final.out"
    kind: str
    dim: int


def probe_sites(
    norms: Sequence[NormSite], include_standardized: bool = INCLUDE_STANDARDIZED
) -> list[ProbeSite]:
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
