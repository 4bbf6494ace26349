"""Runs the angle probe at step 0 and at every scheduled checkpoint step of a training run."""

from __future__ import annotations

import logging
import os
import resource
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from callbacks.checkpointing import CheckpointSchedule
from callbacks.optimizer_step import OptimizerStepCallback
from normgeo.config.schema import TrainProbeSchema
from normgeo.figures.angle_panels import plot_layers
from normgeo.figures.logged_figures import log_figures
from normgeo.measure.pipeline import measure_records, tiktoken_probe_ids, tiktoken_separator
from normgeo.measure.probe import make_references
from normgeo.measure.records import recorded_steps, save_references, write_step
from normgeo.run_folder import ANGLES_FILE, RunFolder
from normgeo.signals import abandonable

log = logging.getLogger(__name__)


def memory_metrics() -> dict[str, float]:
    """``mem/peak_rss_mib`` (the process's high-water mark) and ``mem/rss_mib`` (now), Linux and macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mib = peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux
    metrics = {"mem/peak_rss_mib": float(peak_mib)}
    statm = Path("/proc/self/statm")
    if statm.is_file():
        metrics["mem/rss_mib"] = int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return metrics


class AngleProbe(OptimizerStepCallback):
    """Angles of the hidden vectors before/after every norm
    with 1, ``rand_a``, ``rand_b`` and K null directions.

    The measurement is :func:`normgeo.measure.pipeline.measure_records`, the very one of ``analyze.py``: the
    same checkpoint and tokens give the same records. Every rank probes its own round-robin share of the probe
    windows; the statistics are merged across ranks (no rank-0-only forward pass, which would deadlock
    DDP/FSDP), and rank 0 writes ``angles.jsonl``, ``null.jsonl`` (where 1 stands among the null directions,
    with block-bootstrap intervals over probe sequences), ``energy.jsonl`` (the fraction of each norm input's
    energy along 1 and sqrt(d)/||x||), ``ellipsoid.jsonl`` (each norm's output ellipsoid, from its gain and
    bias), ``intervention.jsonl`` (the loss change when the centering is taken out of LayerNorm or put into
    RMSNorm, per scope of ``intervention``) and the logger entries.
    """

    def __init__(self, run_dir: str, schedule: CheckpointSchedule, source, model_name: str,
                 probe: TrainProbeSchema, *, ids: np.ndarray | None = None) -> None:
        self.folder = RunFolder(run_dir)
        self.schedule = schedule
        self.source = source
        self.model_name = model_name
        self.config = probe
        self._announced = False  # the probe's cost is logged before its first run only
        self._ids = ids  # train.py's start check tokenized them already (normgeo.runs.start)

    def probe_ids(self) -> np.ndarray:
        """The same ``probe.tokens`` token ids at every step and in both arms.

        Documents come in the source's seeded sampling order (spread over the whole source; the seed is
        ``probe.seed``), those shorter than ``min_doc_tokens`` skipped.
        """
        if self._ids is None:
            self._ids = tiktoken_probe_ids(self.source, self.config)
        return self._ids

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        step = trainer.global_step
        if step == 0:
            self.probe(trainer, pl_module, step=0)
        elif step in self.schedule and step not in recorded_steps(self.folder.angles):
            # A stop signal abandoned this step's probe and saved last.ckpt at the step: measure it now.
            self.probe(trainer, pl_module, step=step)

    def on_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if step in self.schedule:
            pl_module.divergence.check()  # no record of weights a non-finite loss updated
            self.probe(trainer, pl_module, step=step)

    def probe(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> list[dict]:
        model = pl_module.model
        config = model.config
        references = make_references(config.n_embd, self.config.seed, self.config.null_directions)
        with abandonable(f"the probe at step {step}"):  # it writes nothing until the end
            records = measure_records(
                model,
                self.probe_ids(),
                config.block_size,
                references,
                self.config,
                batch_size=self.config.batch_size,
                model_name=self.model_name,
                step=step,
                tokens_per_step=pl_module.tokens_per_step,
                with_null=trainer.is_global_zero,
                announce_cost=trainer.is_global_zero and not self._announced,
                autocast=trainer.precision_plugin.forward_context,
                device=pl_module.device,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                separator=tiktoken_separator(),  # the documents' end-of-text in probe_ids
            )
        self._announced = True
        if trainer.is_global_zero:
            save_references(self.folder.references, references)
            # angles.jsonl last: its steps are the probes done (a kill between the writes leaves others newer)
            for name, rows in sorted(records.files.items(), key=lambda item: item[0] == ANGLES_FILE):
                write_step(self.folder.record(name), rows)
            self._log(trainer, records.rows, step, records.intervention)
        return records.rows

    def _log(
        self, trainer: L.Trainer, rows: list[dict], step: int, intervention: Sequence[dict] = ()
    ) -> None:
        """Scalar summaries (mean over layers per site and reference) to every logger; to the loggers with
        a plotting UI (wandb, TensorBoard) also one scalar per layer, ``probe/<site>/<ref>/layer<k>``, so
        that a layer can be plotted across steps, and this step's figure; on wandb also the table."""
        summary: dict[str, list[float]] = {}
        per_layer: dict[str, float] = {}
        for row in rows:
            summary.setdefault(f"probe/{row['site']}/{row['ref']}_deg", []).append(row["mean_deg"])
            layer = f"layer{row['layer']}" if isinstance(row["layer"], int) else str(row["layer"])
            per_layer[f"probe/{row['site']}/{row['ref']}/{layer}"] = row["mean_deg"]
        metrics = {key: float(np.mean(values)) for key, values in summary.items()}
        # The centering intervention, every scope at once: what the model's predictions make of it.
        for row in intervention:
            if row["scope"] == "all":
                for name in ("delta_loss", "kl", "top1_agreement", "cosine"):
                    if row[name] is not None:
                        metrics[f"intervention/{name}"] = row[name]
        # A long run must not grow: the process's peak and current RSS at every probe (flat = no leak).
        metrics.update(memory_metrics())
        plotting = [lg for lg in trainer.loggers if isinstance(lg, (WandbLogger, TensorBoardLogger))]
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, **per_layer} if logger in plotting else metrics, step=step)
            if isinstance(logger, WandbLogger):
                columns = list(rows[0])
                # wandb tables want one type per column: layer mixes block indices and "final".
                data = [[str(r[c]) if c == "layer" else r[c] for c in columns] for r in rows]
                logger.log_table(key="probe/angles", columns=columns, data=data)
        if plotting:
            # The paper-style figure of this step (also kept in <run_dir>/figures): one key, one size.
            figure = plot_layers(rows, self.folder.figures, step=step)
            log_figures(plotting, {"probe/layers": figure}, step=step)
        log.info("probe at step %d: %d records written to %s", step, len(rows), self.folder.angles)
