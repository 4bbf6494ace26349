"""Runs the angle probe at step 0 and at every scheduled checkpoint step of a training run."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from callbacks.checkpointing import CheckpointSchedule, after_optimizer_step
from corpus.sources import probe_documents
from corpus.tokenize import first_tokens, tiktoken_batch_encoder
from normgeo.ellipsoid import ELLIPSOID_FILE, ellipsoid_rows
from normgeo.energy import ENERGY_FILE, EnergyStatistics, energy_rows
from normgeo.logged_figures import log_figures
from normgeo.norm_sites import find_norm_sites
from normgeo.probe import input_sites, make_references, residual_norms, run_probe
from normgeo.records import (
    ANGLES_FILE,
    NULL_FILE,
    REFERENCES_FILE,
    null_rows,
    save_references,
    statistics_rows,
    write_step,
)

log = logging.getLogger(__name__)


class AngleProbe(L.Callback):
    """Angles of the hidden vectors before/after every norm with 1, ``rand_a``, ``rand_b`` and K null directions.

    Every rank probes its own round-robin share of the fixed probe sequences; the statistics are merged
    across ranks (no rank-0-only forward pass, which would deadlock DDP/FSDP), and rank 0 writes
    ``angles.jsonl``, ``null.jsonl`` (where 1 stands among the null directions, with block-bootstrap
    intervals over probe sequences), ``energy.jsonl`` (the fraction of each norm input's energy along 1
    and sqrt(d)/||x||), ``ellipsoid.jsonl`` (each norm's output ellipsoid, from its gain and bias) and the
    logger entries.
    """

    def __init__(
        self,
        run_dir: str,
        schedule: CheckpointSchedule,
        source,
        model_name: str,
        tokens: int = 1_000_000,
        batch_size: int = 8,
        seed: int = 1234,
        tokenizer: str = "gpt2",
        include_standardized: bool = False,
        log_table: bool = True,
        null_directions: int = 64,
        min_doc_tokens: int = 0,
        sample_documents: bool = True,
        bootstrap_replicates: int = 1000,
        bootstrap_block: int = 1,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.schedule = schedule
        self.source = source
        self.model_name = model_name
        self.tokens = tokens
        self.batch_size = batch_size
        self.seed = seed
        self.tokenizer = tokenizer
        self.include_standardized = include_standardized
        self.log_table = log_table
        self.null_directions = null_directions
        self.min_doc_tokens = min_doc_tokens
        self.sample_documents = sample_documents
        self.bootstrap_replicates = bootstrap_replicates
        self.bootstrap_block = bootstrap_block
        self._sequences: torch.Tensor | None = None
        self._last_seen_step = -1

    def probe_sequences(self, seq_len: int) -> torch.Tensor:
        """The same (n, seq_len) token windows at every step and in both arms.

        Documents come in the source's seeded sampling order (spread over the whole source; the seed is
        ``probe.seed``), those shorter than ``min_doc_tokens`` skipped.
        """
        if self._sequences is None:
            encode, eot, _ = tiktoken_batch_encoder(self.tokenizer)
            count = self.tokens // seq_len * seq_len
            if count == 0:
                raise ValueError(f"probe.tokens={self.tokens} is less than one sequence of {seq_len} tokens")
            documents = probe_documents(self.source, sample=self.sample_documents, seed=self.seed)
            ids = first_tokens(documents, encode, eot, count, min_tokens=self.min_doc_tokens)
            self._sequences = torch.from_numpy(ids.reshape(-1, seq_len))
        return self._sequences

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_seen_step = trainer.global_step
        if trainer.global_step == 0:
            self.probe(trainer, pl_module, step=0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not after_optimizer_step(trainer, self._last_seen_step):
            return
        self._last_seen_step = trainer.global_step
        if trainer.global_step in self.schedule:
            self.probe(trainer, pl_module, step=trainer.global_step)

    def probe(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> list[dict]:
        model = pl_module.model
        config = model.config
        sequences = self.probe_sequences(config.block_size)
        shard = sequences[trainer.global_rank :: trainer.world_size]
        # Every rank runs the same number of forward passes (FSDP's all-gathers are collective): a rank
        # with fewer sequences pads its share with rows that are run but not measured.
        per_rank = math.ceil(len(sequences) / trainer.world_size)
        references = make_references(config.n_embd, self.seed, self.null_directions)
        norms = residual_norms(find_norm_sites(model))
        energy = EnergyStatistics(len(norms), device=pl_module.device)
        sites, stats = run_probe(
            model,
            shard,
            references,
            sequence_ids=torch.arange(len(sequences))[trainer.global_rank :: trainer.world_size],
            num_sequences=len(sequences),
            batch_size=self.batch_size,
            include_standardized=self.include_standardized,
            autocast=trainer.precision_plugin.forward_context,
            device=pl_module.device,
            pad_to=per_rank,
            norms=norms,
            energy=energy,
        )
        stats.all_reduce()
        energy.all_reduce()
        tokens_per_step = pl_module.hparams.global_batch * config.block_size
        where = {"model": self.model_name, "norm": config.norm, "step": step, "tokens_seen": step * tokens_per_step}
        ellipsoid = ellipsoid_rows(norms, **where)  # on every rank: sharded gains are gathered collectively
        rows = statistics_rows(
            sites, stats, model=self.model_name, norm=config.norm, step=step, tokens_seen=step * tokens_per_step
        )
        if trainer.is_global_zero:
            save_references(self.run_dir / REFERENCES_FILE, references)
            write_step(self.run_dir / ANGLES_FILE, rows)
            null = null_rows(
                sites, stats, model=self.model_name, norm=config.norm, step=step,
                tokens_seen=step * tokens_per_step, replicates=self.bootstrap_replicates,
                block=self.bootstrap_block, seed=self.seed,
            )
            if null:
                write_step(self.run_dir / NULL_FILE, null)
            # What centering removes per token, and the set the norms' outputs lie in (seed 003).
            write_step(self.run_dir / ENERGY_FILE, energy_rows(input_sites(norms), energy, **where))
            write_step(self.run_dir / ELLIPSOID_FILE, ellipsoid)
            self._log(trainer, rows, step)
        return rows

    def _log(self, trainer: L.Trainer, rows: list[dict], step: int) -> None:
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
        plotting = [lg for lg in trainer.loggers if isinstance(lg, (WandbLogger, TensorBoardLogger))]
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, **per_layer} if logger in plotting else metrics, step=step)
            if self.log_table and isinstance(logger, WandbLogger):
                columns = list(rows[0])
                # wandb tables want one type per column: layer mixes block indices and "final".
                data = [[str(r[c]) if c == "layer" else r[c] for c in columns] for r in rows]
                logger.log_table(key="probe/angles", columns=columns, data=data)
        if self.log_table and plotting:
            # The paper-style figure of this step (also kept in <run_dir>/figures): one key, one size.
            from normgeo.report import plot_layers

            figure = plot_layers(rows, self.run_dir / "figures", step=step)
            log_figures(plotting, {"probe/layers": figure}, step=step)
        log.info("probe at step %d: %d records written to %s", step, len(rows), self.run_dir / ANGLES_FILE)
