"""The angle measurement: every token vector before and after every norm against 1, the two random references
and the null directions, streamed into :class:`normgeo.measure.stats.AngleStatistics` (``angles.jsonl``,
``null.jsonl``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from normgeo.measure.geometry import STANDARDIZABLE_KINDS, standardize
from normgeo.measure.measurement import Measurement, ProbeBatch, RecordKeys
from normgeo.measure.norm_sites import NormSite
from normgeo.measure.probe import INCLUDE_STANDARDIZED, NULL_KEY, REFERENCE_NAMES, ProbeSite, probe_sites
from normgeo.measure.records import null_rows, statistics_rows
from normgeo.measure.stats import AngleStatistics
from normgeo.run_folder import ANGLES_FILE, NULL_FILE


class AngleMeasurement(Measurement):
    """Angles at each norm's ``in``, ``out`` (and ``std``: the input standardized, LayerNorm/RMSNorm only).

    ``references`` are :func:`normgeo.measure.probe.make_references`'s (with ``NULL_KEY`` for the null
    directions); per-sequence sums are kept for ``num_sequences`` probe sequences (the block bootstrap of
    ``null.jsonl``). ``with_null=False`` leaves ``null.jsonl``'s rows out of :meth:`records` (their
    bootstrap costs; only the rank that writes needs them).
    """

    def __init__(self, norms: Sequence[NormSite], references: dict[str, np.ndarray], *, num_sequences: int,
                 device: torch.device | str = "cpu", include_standardized: bool = INCLUDE_STANDARDIZED,
                 with_null: bool = True, bootstrap_replicates: int = 1000, bootstrap_block: int = 1,
                 seed: int = 1234) -> None:
        self.norms = list(norms)
        self.include_standardized = include_standardized
        self.sites = probe_sites(self.norms, include_standardized)
        self.device = torch.device(device)
        null = references.get(NULL_KEY)
        self.stats = AngleStatistics(
            len(self.sites),
            torch.from_numpy(np.stack([references[name] for name in REFERENCE_NAMES])),
            device=self.device,
            null_directions=torch.from_numpy(null) if null is not None and len(null) else None,
            num_sequences=num_sequences,
        )
        # Per norm: the statistics' number of its first site; its sites (in, std, out) are consecutive.
        index = {site: i for i, site in enumerate(self.sites)}
        self.first_site = [
            index[ProbeSite(norm.layer, f"{norm.role}.in", norm.kind, norm.dim)] for norm in self.norms
        ]
        self.with_null = with_null
        self.bootstrap = {"replicates": bootstrap_replicates, "block": bootstrap_block, "seed": seed}
        self.sequence_ids: torch.Tensor | None = None  # the batch's, on self.device

    def before_batch(self, batch: ProbeBatch) -> None:
        # Once a batch, not at every norm: a copy from the host waits for the GPU's queued work.
        self.sequence_ids = batch.sequence_ids.to(self.device)

    def observe_norm(self, index: int, norm: NormSite, inputs: torch.Tensor, output: torch.Tensor,
                     batch: ProbeBatch) -> None:
        # One update of the norm's consecutive sites, in probe_sites' order: in, std (where kept), out.
        vectors = inputs.to(self.device)
        standardized = self.include_standardized and norm.kind in STANDARDIZABLE_KINDS
        # An RMSNorm's standardized input points along its input: the input's angles serve for both, and
        # its norms follow from the input's (it is never made).
        rms = standardized and norm.kind == "rms"
        middle = [standardize(vectors.float(), norm.kind, norm.eps)] if standardized and not rms else []
        self.stats.update_sites(self.first_site[index], [vectors, *middle, output.to(self.device)],
                                self.sequence_ids, rms_standardized=(1, norm.eps) if rms else None)

    def all_reduce(self) -> None:
        self.stats.all_reduce()

    def records(self, where: RecordKeys) -> dict[str, list[dict]]:
        files = {ANGLES_FILE: statistics_rows(self.sites, self.stats, **where)}
        if self.with_null:
            files[NULL_FILE] = null_rows(self.sites, self.stats, **where, **self.bootstrap)
        return files
