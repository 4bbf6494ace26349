"""The one shape of a measurement over the probe tokens.

The pipeline (:func:`normgeo.measure.pipeline.run_probe`) runs the intact forward of each probe batch once,
with one hook per norm, and hands every measurement in its list the same things in the same order:

1. ``with measurement:`` around the whole probe (hooks of its own, if any; removed whatever happens);
2. :meth:`Measurement.before_batch`, then :meth:`Measurement.observe_norm` inside the intact forward, for each
   norm's input and output (real rows only, never padding);
3. :meth:`Measurement.observe_batch` after the intact forward, with its output and a way to run more
   forwards (the centering intervention); it may run forwards on a batch with no real rows, so that every
   rank of a sharded model makes the same collective calls;
4. :meth:`Measurement.all_reduce` once at the end (every rank's sums into every rank's);
5. :meth:`Measurement.records` for the rows of each file it writes.

Adding a measurement is one class with these methods and one line in
:func:`normgeo.measure.pipeline.measure_records`'s list. Nothing here holds more than one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from normgeo.measure.norm_sites import NormSite


@dataclass
class ProbeBatch:
    """One probe batch as every measurement sees it.

    ``tokens`` (rows, T) are on the probe's device; its first ``rows`` rows are probe sequences number
    ``sequence_ids`` (global over the probe and the ranks), the rest padding. ``lead_id`` is the smallest
    global sequence id any rank holds in this batch: the same on every rank, so a decision made from it
    (run the intervention's forwards or not) is collective-safe. ``forward`` runs the model on token ids
    (as the intact forward did); ``output`` is the intact forward's (None inside the forward).
    ``progress(n)`` advances the probe's progress bar by n forwards. ``document_starts`` (bool, the shape of
    ``tokens``, on the same device; padding rows false) marks the tokens that begin a document of the packed
    probe stream; None where the pipeline was given no separator (where documents start is unknown).
    ``documents`` (int64, the same shape; padding rows 0) numbers the document of the probe stream each token
    belongs to (0, 1, ...; a separator is its document's), None where the starts are.
    """

    tokens: torch.Tensor
    rows: int
    sequence_ids: torch.Tensor
    lead_id: int
    forward: Callable[[torch.Tensor], object]
    output: object = None
    progress: Callable[[float], None] = lambda forwards: None
    document_starts: torch.Tensor | None = None
    documents: torch.Tensor | None = None


RecordKeys = dict  # {"model", "norm", "step", "tokens_seen"}: the keys every record row starts with


class Measurement:
    """Base class: every step is a no-op, so a measurement overrides only what it needs."""

    def __enter__(self) -> Measurement:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def before_batch(self, batch: ProbeBatch) -> None:
        """Before the intact forward of ``batch`` (its ``output`` is still None)."""

    def observe_norm(self, index: int, norm: NormSite, inputs: torch.Tensor, output: torch.Tensor,
                     batch: ProbeBatch) -> None:
        """Norm number ``index`` of the residual norms saw ``inputs`` and gave ``output`` (real rows only)."""

    def observe_batch(self, batch: ProbeBatch) -> None:
        """After the intact forward of ``batch``."""

    def reads_output(self, lead_id: int) -> bool:
        """Whether :meth:`observe_batch` reads the intact forward's ``output`` (the logits) of the batch whose
        ``lead_id`` is given: where no measurement does, the probe may run the model without its head."""
        return False

    def forwards_per_batch(self, lead_id: int) -> float:
        """Extra forwards (in units of one full forward) that :meth:`observe_batch` runs for the batch whose
        ``lead_id`` is given: the cost the probe announces before it starts and its progress bar counts."""
        return 0.0

    def all_reduce(self) -> None:
        """Sum every rank's state into every rank's (a no-op outside torch.distributed)."""

    def records(self, where: RecordKeys) -> dict[str, list[dict]]:
        """File name -> its rows, each starting with ``where``."""
        return {}
