"""A non-finite loss, with one owner: noticed on the device at every optimizer step without a host wait
(:meth:`Divergence.note`), read back where the host waits anyway (:meth:`Divergence.check`), the weights
checked before a checkpoint could keep them (:meth:`Divergence.check_weights`), said in one message raised on
every rank at once (:class:`NonFiniteError`). What the run then records is normgeo.runs.session's."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from corpus.refusal import Refusal


class NonFiniteError(Refusal, RuntimeError):
    """Training diverged (loss or parameters inf/NaN): ``what`` went non-finite, the likely fix, and
    ``then``: what became of the run (normgeo.runs.session.mark_diverged)."""

    def __init__(self, what: str, *, step: int, loss: float, lr: float, then: str = "") -> None:
        fix = f"the likely cause is the learning rate, optim.lr={lr:g}: lower it (e.g. optim.lr={lr / 10:g})"
        super().__init__(f"training diverged: {what}; {fix}" + (f"; {then}" if then else ""))
        self.what, self.step, self.loss, self.lr = what, step, loss, lr


class Divergence:
    """The first optimizer step whose loss was inf or NaN, and that loss, kept on the device."""

    def __init__(self, lr: float) -> None:
        self.lr = lr  # the peak learning rate the message names
        self.step: torch.Tensor | None = None  # -1: none yet
        self.loss: torch.Tensor | None = None

    def note(self, loss: torch.Tensor, step: int) -> None:
        """Optimizer step ``step``'s all-reduced loss, noted on the device: no host wait."""
        if self.step is None:
            self.step = torch.full((), -1, dtype=torch.long, device=loss.device)
            self.loss = torch.zeros((), dtype=loss.dtype, device=loss.device)
        first = (self.step < 0) & ~torch.isfinite(loss)
        self.step = torch.where(first, step, self.step)
        self.loss = torch.where(first, loss, self.loss)

    def check(self, *also: torch.Tensor) -> list[float]:
        """Raise :class:`NonFiniteError` naming the first step whose loss was not finite, if any; waits for
        the device once, and returns the values of the device scalars ``also`` read in the same wait. Every
        rank holds the same all-reduced losses, so all raise at once."""
        if self.step is None:
            return [float(value) for value in also]
        read = (self.step, self.loss, *also)
        step, loss, *values = torch.stack([value.double() for value in read]).tolist()
        if step < 0:
            return values
        raise NonFiniteError(f"the training loss is {loss} at step {int(step)}", step=int(step), loss=loss,
                             lr=self.lr)

    def check_weights(self, parameters: Iterable[torch.Tensor], strategy, step: int, kept: str) -> None:
        """Before a checkpoint is written: :meth:`check`, then the parameters, so that a good checkpoint is
        never overwritten by weights that diverged (``kept``: what is left, for the message). Each rank checks
        what it holds in one wait; the decision is all-reduced (``strategy``: Lightning's)."""
        self.check()
        finite = bool(torch.stack([torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()
                                   for p in parameters]).all())
        if not strategy.reduce_boolean_decision(finite, all=True):
            raise NonFiniteError(f"the parameters are not finite after step {step} (stopped without saving; "
                                 f"{kept})", step=step, loss=float("nan"), lr=self.lr)
