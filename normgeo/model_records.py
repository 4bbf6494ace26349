"""One model's measurement, the one path of ``analyze.py`` and ``normgeo.measure(model, ...)``: the norms
and window length it is measured with (:func:`probe_setup`), its records (:func:`measure_model`), and those
records as DataFrames, drawn (:meth:`ModelRecords.plot`) and written as ``analyze.py`` writes them
(:meth:`ModelRecords.save`), so that every tool reads an analysis made in a notebook."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

from corpus.atomic import atomic_write_json
from models.pretrained import max_positions
from normgeo.figures.angle_panels import layers_figure, write_run_figures
from normgeo.figures.model_summary import summarize, write_summary
from normgeo.measure.norm_sites import NormSite, find_norm_sites
from normgeo.measure.pipeline import AnalysisError, Records, measure_records, norm_kind
from normgeo.measure.probe import make_references, residual_norms
from normgeo.measure.probe_config import ProbeConfig
from normgeo.measure.records import save_references, write_step
from normgeo.paths import check_own_folder
from normgeo.readers.frames import RecordFrames
from normgeo.run_folder import (
    INTERVENTION_FILE,
    INTERVENTION_POSITIONS_FILE,
    MEAN_SOURCES_FILE,
    RUN_INFO_FILE,
    RunFolder,
)
from normgeo.runs.run_config import OUTPUT_MARKERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeSetup:
    """What a model is measured with, known before any text is tokenized."""

    norms: list[NormSite]
    kind: str  # the records' norm kind: "layer", "rms", ...
    dim: int  # the residual stream's width d
    seq_len: int  # the probe windows' length: the one asked for, capped at the model's positions


def probe_setup(model: nn.Module, probe: ProbeConfig, seq_len: int, seq_len_key: str) -> ProbeSetup:
    """The model's norms and the window length ``seq_len`` capped at its positions; :class:`AnalysisError`
    when the probe cannot give intervals in such windows (``seq_len_key`` names the key to change)."""
    norms = find_norm_sites(model)
    limit = max_positions(model)
    seq_len = min(seq_len, limit) if limit else seq_len
    if refusal := probe.size_refusal(seq_len, seq_len_key):
        raise AnalysisError(refusal)
    return ProbeSetup(norms=norms, kind=norm_kind(norms), dim=residual_norms(norms)[0].dim, seq_len=seq_len)


@dataclass
class ModelRecords(RecordFrames):
    """The records ``analyze.py`` writes for one model: a DataFrame per record file (``angles``, ``null``,
    ``energy``, ``mean_sources``, ``intervention``; ``frame(name)`` for the others), the reference
    vectors, and ``info`` (``run_info.json``)."""

    records: Records
    references: dict[str, np.ndarray]
    info: dict = field(default_factory=dict)

    @property
    def files(self) -> dict[str, list[dict]]:
        return self.records.files

    @property
    def summary(self) -> list[dict]:
        """Pooled over tokens and layers, as ``summary.csv`` (normgeo.figures.model_summary.summarize)."""
        return summarize(self.records.rows, self.records.null)

    def plot(self, roles: Sequence[str] | None = None) -> Figure:
        """The paper's per-layer figure: the angle with 1 and two random directions before and after every
        norm (``roles``: which norms, e.g. ["ln1"]; default all), as ``analyze.py`` draws it."""
        figure = layers_figure(self.records.rows, self.records.rows[0]["step"], roles)
        plt.close(figure)  # shown once in a notebook: as the returned value, not also as an open figure
        return figure

    def save(self, folder: str | Path) -> list[Path]:
        """Write exactly the files ``analyze.py`` writes into ``folder`` (records, references, figures,
        summary, run_info.json); an earlier analysis's intervention or mean sources, which this one did not
        measure, are removed with their figures. Returns the figures written. FolderError, writing nothing,
        for a folder analyze.py's out_dir may not be: one holding (or inside) a run or another command's
        outputs."""
        out_dir = Path(folder)
        check_own_folder(out_dir, "folder", OUTPUT_MARKERS, own=RUN_INFO_FILE, beside="analysis")
        out_dir.mkdir(parents=True, exist_ok=True)
        run = RunFolder(out_dir)
        save_references(run.references, self.references)
        for name, file_rows in self.records.files.items():
            write_step(run.record(name), file_rows)
        # An earlier analysis's intervention or mean sources (records and figures) would read as this one's.
        for measured, names, figures, what in (
            (bool(self.records.intervention), (INTERVENTION_FILE, INTERVENTION_POSITIONS_FILE),
             "intervention_*", "intervention (probe.intervention=[])"),
            (MEAN_SOURCES_FILE in self.records.files, (MEAN_SOURCES_FILE,), "mean_sources_*",
             "mean sources (probe.mean_sources=false)"),
        ):
            stale = [*map(run.record, names), *run.figures.glob(figures)]
            if not measured and any(path.exists() for path in stale):
                for path in stale:
                    path.unlink(missing_ok=True)
                log.warning("removed %s and its figures from an earlier analysis: this run measured no %s",
                            names[0], what)
        figures = write_run_figures(out_dir)
        write_summary(out_dir, self.summary)
        atomic_write_json(run.run_info, self.info)
        return figures


def measure_model(model: nn.Module, ids: np.ndarray, setup: ProbeSetup, probe: ProbeConfig, *,
                  batch_size: int, name: str, source: str, probe_source: str, step: int | None = None,
                  tokens_per_step: int | None = None, forward: Callable[[torch.Tensor], object] | None = None,
                  headless: Callable[[torch.Tensor], object] | None = None,
                  device: torch.device | None = None, progress: bool = False, announce_cost: bool = False,
                  separator: int | None = None) -> ModelRecords:
    """Every measurement ``probe`` asks for on the token stream ``ids`` in windows of ``setup.seq_len``
    (forwards of ``batch_size`` of them) (:func:`normgeo.measure.pipeline.measure_records`), the records'
    ``model`` field ``name``; ``info`` holds what ``run_info.json`` says of the model (loaded from ``source``)
    and the probe (its text from ``probe_source``)."""
    started = time.perf_counter()
    references = make_references(setup.dim, probe.seed, probe.null_directions)
    records = measure_records(model, ids, setup.seq_len, references, probe, batch_size=batch_size,
                              model_name=name, step=step, tokens_per_step=tokens_per_step, forward=forward,
                              headless=headless, norms=setup.norms, device=device, progress=progress,
                              announce_cost=announce_cost, separator=separator)
    seconds = time.perf_counter() - started
    parameter = next(model.parameters())
    info = {
        "model": name,
        "source": source,
        "norm": setup.kind,
        "params": sum(p.numel() for p in model.parameters()),
        "dim": setup.dim,
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "device": str(device or parameter.device),
        "seq_len": setup.seq_len,
        "batch_size": batch_size,
        "tokens": len(ids),
        "probe_source": probe_source,
        "probe_sampled": probe.sample,
        "probe_min_doc_tokens": probe.min_doc_tokens,
        "probe_max_doc_tokens": probe.max_doc_tokens,
        "null_directions": probe.null_directions,
        "probe_s": round(seconds, 2),
        "tokens_per_s": round(len(ids) / seconds, 1),
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cuda_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available()
        else None,
        "torch": torch.__version__,
    }
    return ModelRecords(records=records, references=references, info=info)
