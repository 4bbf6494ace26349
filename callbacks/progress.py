"""The training console: one progress line counted in optimizer steps, and less Lightning noise.

:class:`StepProgressBar` subclasses Lightning's :class:`~lightning.pytorch.callbacks.ProgressBar` base and
draws with tqdm itself, rather than subclassing ``TQDMProgressBar`` or ``RichProgressBar``. Those count
the batches of an epoch (micro-batches: with gradient accumulation, several per optimizer step) under an
``Epoch 0/-2`` title (training here is one endless epoch cut off at ``max_steps``), add ``v_num`` and open
a second bar for every validation; making them count optimizer steps would mean overriding nearly every
hook while their totals still assume epochs. tqdm rather than rich: rich's live display draws nothing
until it stops when stderr is not a terminal (a SLURM log would stay empty for the whole run), and
tqdm's ``logging_redirect_tqdm`` keeps log lines (probe, checkpoints) from tearing the bar.

On a terminal the bar reads ``step 40/100 |████      | loss 6.1234 · 41.2k train tok/s · 00:12 elapsed · ETA
00:18``. When stderr is not a terminal (SLURM logs, pipes, tests) there is no bar: the same status is
logged as a plain line at the first step, every ``log_interval_s`` seconds, after each validation and at
the end. Only rank 0 prints (Lightning disables progress bars on the other ranks).

:func:`quiet_lightning` drops Lightning's start-up noise by message, and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)

# --- pure formatting -------------------------------------------------------------------------------


def eta_seconds(step: int, total: int, *, since_step: int, elapsed: float) -> float | None:
    """Seconds until step ``total`` at the mean pace of the ``step - since_step`` steps done in ``elapsed``
    seconds; None while no step has been timed or the total is unknown (``total <= 0``)."""
    done = step - since_step
    if done <= 0 or total <= 0:
        return None
    return max(total - step, 0) * elapsed / done


def format_duration(seconds: float | None) -> str:
    """tqdm's ``00:07``, ``12:34``, ``3:02:01``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    return tqdm.format_interval(max(seconds, 0.0))


def format_metrics(metrics: Mapping[str, Any], validated_at: int | None = None) -> list[str]:
    """The progress-bar metrics as ``name value`` fields: losses to 4 decimals, the validation loss with the
    step it was measured after (``validated_at``), the last optimizer step's training rate last (``train
    tok/s``: tokens of that step over the time since the step before)."""
    fields, rate = [], None
    for name, value in metrics.items():
        if name == "v_num":
            continue
        if name == "tok/s" and isinstance(value, (int, float)):
            # the last step's; the summary's rate is overall
            rate = f"{tqdm.format_sizeof(value)} train tok/s"
        elif name == "val/loss" and isinstance(value, float) and validated_at is not None:
            fields.append(f"{name} {value:.4f} (step {validated_at})")
        elif isinstance(value, float) and name.endswith("loss"):
            fields.append(f"{name} {value:.4f}")
        elif isinstance(value, float):
            fields.append(f"{name} {value:.4g}")
        else:
            fields.append(f"{name} {value}")
    return fields + ([rate] if rate else [])


def status_fields(metrics: Mapping[str, Any], *, elapsed: float, eta: float | None, total: int,
                  validated_at: int | None = None) -> list[str]:
    """Everything after the step count: metrics, elapsed time, ETA (when the total is known)."""
    fields = format_metrics(metrics, validated_at) + [f"{format_duration(elapsed)} elapsed"]
    if total > 0:
        fields.append(f"ETA {format_duration(eta)}")
    return fields


def step_text(step: int, total: int) -> str:
    return f"step {step}/{total}" if total > 0 else f"step {step}"


BAR_WIDTH = 20


def bar_format(step: int, total: int, text: str, columns: int) -> str:
    """tqdm's ``bar_format`` for ``step k/N |bar| text`` on a terminal ``columns`` wide (0: unknown). The
    bar narrows, then goes, on a narrow terminal, so that the text after it stays whole."""
    if total <= 0:
        return "step {n_fmt} {desc}"
    room = columns - 1 - len(step_text(step, total)) - len(" || ") - len(text) if columns > 0 else BAR_WIDTH
    width = min(BAR_WIDTH, room)
    if width < 5:
        return "step {n_fmt}/{total_fmt} {desc}"
    # {desc} after the bar: tqdm puts ", " before {postfix} and ": " after {l_bar}, not around {desc}.
    return f"step {{n_fmt}}/{{total_fmt}} |{{bar:{width}}}| {{desc}}"


# --- the progress bar ------------------------------------------------------------------------------

SEPARATOR = " · "


def _is_console_handler(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class StepProgressBar(ProgressBar):
    """Progress in optimizer steps (``trainer.global_step`` of ``trainer.max_steps``), from the restored step
    on resume, with the module's ``prog_bar`` metrics (``loss``, ``tok/s``, ``val/loss``), elapsed time and
    ETA. Validation shows as ``validating`` in the line, then its loss among the metrics.

    ``interactive``: draw a tqdm bar (default: when ``file`` is a terminal); otherwise log plain status
    lines every ``log_interval_s`` seconds. ``file``: where the bar goes (default stderr).
    """

    def __init__(self, *, log_interval_s: float = 30.0, interactive: bool | None = None,
                 file: TextIO | None = None):
        super().__init__()
        self.log_interval_s = log_interval_s
        self._interactive = interactive
        self._file = file
        self._enabled = True
        self._bar: tqdm | None = None
        self._redirect: contextlib.ExitStack | None = None
        self._total = 0
        self._start: tuple[int, float] = (0, 0.0)  # (step, time) when this session's training started
        # The first step done this session: the ETA's origin, past its one-off costs (compile, warm-up).
        self._pace: tuple[int, float] | None = None
        self._step = 0
        self._logged_step = -1
        self._logged_at = -math.inf
        self._validating = False
        self._metrics: dict[str, Any] = {}  # the module's prog_bar metrics as last read

    # ProgressBar's interface
    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.write(sep.join(map(str, args)), file=self._stream)
        else:
            print(*args, sep=sep, **kwargs)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The module's console figures (LitGPT's ``console_metrics``: the latest report's loss and rate,
        host values), then its ``prog_bar`` metrics (the validation loss), without the logger version
        (``v_num``)."""
        return {**getattr(pl_module, "console_metrics", {}), **trainer.progress_bar_metrics}

    @property
    def _stream(self) -> TextIO:
        return self._file if self._file is not None else sys.stderr

    @property
    def interactive(self) -> bool:
        if self._interactive is not None:
            return self._interactive
        isatty = getattr(self._stream, "isatty", None)
        return bool(isatty and isatty())

    # hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled:
            return
        self._total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 0
        self._step = trainer.global_step
        self._start = (trainer.global_step, time.monotonic())
        self._pace = None
        if self.interactive:
            self._bar = tqdm(
                total=self._total or None,
                initial=self._step,
                file=self._stream,
                # A pseudo-terminal without a size (script, some containers) reports 0 x 0: tqdm would
                # then draw nothing at all.
                **({"dynamic_ncols": True} if _columns(self._stream) else {"ncols": 200, "nrows": 24}),
                bar_format=bar_format(self._step, self._total, "", _columns(self._stream)),
                mininterval=0,
                smoothing=0,
            )
            self._redirect = contextlib.ExitStack()
            loggers = [logging.root, logging.getLogger("lightning.pytorch"),
                       logging.getLogger("lightning.fabric")]
            loggers = [lg for lg in loggers if any(_is_console_handler(h) for h in lg.handlers)]
            if loggers:
                self._redirect.enter_context(logging_redirect_tqdm(loggers=loggers))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        # Called for every micro-batch; the count moves on accumulation boundaries only.
        if not self._enabled or trainer.global_step == self._step:
            return
        now = time.monotonic()
        self._step = trainer.global_step
        if self._pace is None:
            self._pace = (self._step, now)
        first, last = self._step == self._pace[0], self._total and self._step >= self._total
        self._show(trainer, pl_module, now, force=bool(first or last))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and not trainer.sanity_checking:
            self._validating = True
            self._show(trainer, pl_module, time.monotonic(), force=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and self._validating:
            self._validating = False
            self._show(trainer, pl_module, time.monotonic(), force=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and self._bar is None and self._logged_step != self._step:
            self._show(trainer, pl_module, time.monotonic(), force=True)  # e.g. stop_at_step before the total
        self._close()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close()

    # drawing
    def _fields(self, trainer: L.Trainer, pl_module: L.LightningModule, now: float) -> list[str]:
        origin = self._pace if self._pace is not None and self._step > self._pace[0] else self._start
        eta = eta_seconds(self._step, self._total, since_step=origin[0], elapsed=now - origin[1])
        fields = status_fields(
            self._metrics, elapsed=now - self._start[1], eta=eta, total=self._total,
            validated_at=getattr(pl_module, "validated_at", None),  # LitGPT's; another module's: not said
        )
        return fields + (["validating"] if self._validating else [])

    def _show(self, trainer: L.Trainer, pl_module: L.LightningModule, now: float, *, force: bool) -> None:
        # Reading Lightning's prog_bar metrics converts any device tensor a module logged there (a wait for
        # the device): the bar, drawn at every step, reads them where the module logs new ones (every
        # log_every_n_steps) or when forced.
        if self._bar is not None:
            if force or self._step % max(trainer.log_every_n_steps, 1) == 0 or not self._metrics:
                self._metrics = self.get_metrics(trainer, pl_module)
            text = SEPARATOR.join(self._fields(trainer, pl_module, now))
            self._bar.n = self._step
            self._bar.bar_format = bar_format(self._step, self._total, text, _columns(self._stream))
            self._bar.set_description_str(text, refresh=False)
            self._bar.refresh()
        elif force or now - self._logged_at >= self.log_interval_s:
            if self._validating:
                return  # the line after validation carries its loss
            self._metrics = self.get_metrics(trainer, pl_module)
            log.info(
                "%s",
                SEPARATOR.join([step_text(self._step, self._total), *self._fields(trainer, pl_module, now)]),
            )
            self._logged_step, self._logged_at = self._step, now

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None


# --- start-up noise --------------------------------------------------------------------------------

# Lightning's rank-zero info lines that say nothing about this run (message prefixes).
NOISE_LINES = (
    "💡 Tip:",  # the litlogger advertisement
    "GPU available:",
    "TPU available:",
)
# Lightning and torch warnings that are not ours to act on (regexes matched at the message's start).
NOISE_WARNINGS = (
    # torch deprecated LeafSpec; lightning.pytorch.utilities._pytree still builds one
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # srun on PATH but not used: also true of every local or login-node run on a SLURM cluster
    (r"The `srun` command is available on your system but is not used", Warning),
    # training is one "epoch" of max_steps x accumulation batches; log_every counts optimizer steps
    (r"The number of training batches \(\d+\) is smaller than the logging interval", Warning),
    # untrue here: corpus.stream.StepSampler starts the batch stream at the restored global step
    (r"You're resuming from a checkpoint that ended before the epoch ended", Warning),
)
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning_utilities.core.rank_zero")


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(NOISE_LINES)


def quiet_lightning() -> None:
    """Drop the messages above, matched by text: the litlogger tip, the GPU/TPU availability lines, the
    ``srun`` hint, torch's ``LeafSpec`` deprecation, the logging-interval warning and the "dataloader is not
    resumable" warning on resume. Every other log line and warning stays. Call before the Trainer (and any
    ``SLURMEnvironment``) is built; idempotent."""
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines())
    for message, category in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)  # replaces its own duplicate
