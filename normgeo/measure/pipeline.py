"""The one measurement pipeline: (model, probe tokens, references) -> records.

The training callback (``callbacks/angle_probe.py``, every rank its share) and ``analyze.py`` (one
process) both call :func:`probe_ids` for the tokens and :func:`measure_records` for the records, so the
same checkpoint and tokens give the same records whichever measured them: one windowing rule
(:func:`windows`), one ``tokens_seen`` rule (:func:`tokens_seen`) and one ``include_standardized``
default (:data:`normgeo.measure.probe.INCLUDE_STANDARDIZED`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from corpus.sources import SourceError, probe_documents
from corpus.tokenize import EncodeBatch, first_tokens, tiktoken_batch_encoder
from models.gpt import GPT
from normgeo.measure.ellipsoid import ellipsoid_rows
from normgeo.measure.energy import EnergyStatistics, energy_rows
from normgeo.measure.intervention import InterventionProbe, intervention_rows, intervention_scopes
from normgeo.measure.norm_sites import NormSite, find_norm_sites
from normgeo.measure.probe import INCLUDE_STANDARDIZED, ProbeSite, input_sites, residual_norms, run_probe
from normgeo.measure.records import null_rows, statistics_rows
from normgeo.measure.stats import AngleStatistics


class AnalysisError(RuntimeError):
    """A user error in a measurement (bad config, too small a corpus); the message says what to fix."""


def probe_ids(
    source,
    encode_batch: EncodeBatch,
    separator: int | None,
    tokens: int,
    *,
    sample: bool = True,
    seed: int = 1234,
    min_doc_tokens: int = 0,
) -> np.ndarray:
    """The first ``tokens`` token ids of the source's documents in its seeded sampling order (those under
    ``min_doc_tokens`` skipped); an :class:`AnalysisError` saying what to change if there are fewer."""
    if tokens <= 0:
        raise AnalysisError(f"probe.tokens must be positive, not {tokens}")
    try:
        documents = probe_documents(source, sample=sample, seed=seed)
        return first_tokens(documents, encode_batch, separator, tokens, min_tokens=min_doc_tokens)
    except SourceError as exc:  # a ValueError too, but about reading the corpus, not its size
        raise AnalysisError(
            f"{exc} Or probe a local copy of the text: probe=local probe.path=<folder or file>"
        ) from exc
    except ValueError as exc:
        raise AnalysisError(f"{exc} ({source.describe()}): lower probe.tokens or give a larger corpus") from exc


def tiktoken_probe_ids(
    source, tokens: int, *, tokenizer: str = "gpt2", sample: bool = True, seed: int = 1234, min_doc_tokens: int = 0
) -> np.ndarray:
    """:func:`probe_ids` with a tiktoken encoding: the training probe's tokens, computed once by train.py's
    start check (normgeo.runs.start) and handed to the probe callback."""
    encode, eot, _ = tiktoken_batch_encoder(tokenizer)
    return probe_ids(source, encode, eot, tokens, sample=sample, seed=seed, min_doc_tokens=min_doc_tokens)


def windows(ids: np.ndarray | torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """The one windowing rule: ``(n, seq_len)`` windows, then the tokens that do not fill one as a
    single shorter ``(1, rest)`` window, so every probe token is measured exactly once (the paper's
    round 1M, not 976 windows of 1024)."""
    tokens = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    whole = len(tokens) // seq_len * seq_len
    parts = [tokens[:whole].view(-1, seq_len)] if whole else []
    return parts + ([tokens[whole:].unsqueeze(0)] if whole < len(tokens) else [])


def tokens_seen(step: int | None, tokens_per_step: int | None) -> int | None:
    """The one ``tokens_seen`` rule: training tokens before the measured weights (step x tokens per
    optimizer step); ``None`` where that is unknown (a released model: no step)."""
    if step is None or tokens_per_step is None:
        return None
    return step * tokens_per_step


def norm_kind(norms: Sequence[NormSite] | Sequence[ProbeSite]) -> str:
    """The model's norm kind for the records: "layer" or "rms" ("layer+rms" should a model mix them)."""
    return "+".join(sorted({norm.kind for norm in residual_norms(norms)}))


def measure(
    model: nn.Module,
    ids: np.ndarray | torch.Tensor,
    seq_len: int,
    references: dict[str, np.ndarray],
    *,
    batch_size: int,
    forward: Callable[[torch.Tensor], object] | None = None,
    norms: Sequence[NormSite] | None = None,
    include_standardized: bool = INCLUDE_STANDARDIZED,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    device: torch.device | str | None = None,
    progress: bool = False,
    rank: int = 0,
    world_size: int = 1,
    energy: EnergyStatistics | None = None,
    intervention_kinds: Sequence[str] = (),
) -> tuple[list[ProbeSite], AngleStatistics, InterventionProbe | None]:
    """Angles at every norm for every token of ``ids`` cut by :func:`windows`, merged over ranks.

    Rank ``rank`` of ``world_size`` measures windows ``rank, rank + world_size, ...`` of each part and
    pads its share to as many forward passes as the largest (a sharded model's all-gathers are
    collective); the statistics are then all-reduced, so every rank returns the whole probe's.
    ``energy``: also stream what centering removes at every residual norm's input into it (all-reduced too).
    ``intervention_kinds``: the scopes of the centering intervention to run after each forward
    (:func:`normgeo.measure.intervention.intervention_scopes`); its sums come back all-reduced (None when
    no scope was asked for or the model has no norm to intervene on).
    """
    parts = windows(ids, seq_len)
    if not parts:
        raise AnalysisError("no probe tokens to measure")
    num_sequences = sum(len(part) for part in parts)
    residual = residual_norms(list(norms) if norms is not None else find_norm_sites(model))
    scopes = intervention_scopes(residual, intervention_kinds) if intervention_kinds else []
    where = torch.device(device) if device is not None else next(model.parameters()).device
    intervention = InterventionProbe(residual, scopes, num_sequences, device=where) if scopes else None
    sites: list[ProbeSite] = []
    stats: AngleStatistics | None = None
    first = 0  # global index of the part's first window, for the per-sequence statistics
    with intervention or contextlib.nullcontext():
        for index, part in enumerate(parts):
            global_ids = torch.arange(first, first + len(part))
            part_sites, part_stats = run_probe(
                model,
                part[rank::world_size],
                references,
                forward=forward,
                norms=residual,
                batch_size=batch_size,
                include_standardized=include_standardized,
                autocast=autocast,
                device=device,
                progress=progress and index == 0,
                pad_to=math.ceil(len(part) / world_size),
                sequence_ids=global_ids[rank::world_size],
                num_sequences=num_sequences,
                energy=energy,
                on_batch=intervention.observe if intervention is not None else None,
            )
            first += len(part)
            if stats is None:
                sites, stats = part_sites, part_stats
            else:
                stats.merge(part_stats)
    assert stats is not None
    stats.all_reduce()
    if energy is not None:
        energy.all_reduce()
    if intervention is not None:
        intervention.all_reduce()
    return sites, stats, intervention


@dataclass
class Records:
    """What one measurement yields: ``angles.jsonl``'s rows, ``null.jsonl``'s (if asked for),
    ``energy.jsonl``'s (what centering removes at each norm input), ``ellipsoid.jsonl``'s (the set
    each norm's outputs lie in, from its gain and bias) and ``intervention.jsonl``'s (what the model
    predicts with the centering taken out or put in; [] when not asked for)."""

    sites: list[ProbeSite]
    stats: AngleStatistics
    rows: list[dict]
    null: list[dict]
    energy: list[dict]
    ellipsoid: list[dict]
    norm: str
    intervention: list[dict]


def record_norm_label(model: nn.Module, sites: Sequence[ProbeSite]) -> str:
    """The ``norm`` field of the records: our GPT's configured arm (``layer_nobias`` and ``rms_bias`` are
    LayerNorm and RMSNorm modules too), else the kind found in the model."""
    return model.config.norm if isinstance(model, GPT) else norm_kind(sites)


def measure_records(
    model: nn.Module,
    ids: np.ndarray | torch.Tensor,
    seq_len: int,
    references: dict[str, np.ndarray],
    *,
    model_name: str,
    step: int | None,
    tokens_per_step: int | None,
    seed: int,
    bootstrap_replicates: int = 1000,
    bootstrap_block: int = 1,
    with_null: bool = True,
    intervention_kinds: Sequence[str] = (),
    **measure_kwargs,
) -> Records:
    """:func:`measure`, then the records: ``model_name``, the model's norm (:func:`record_norm_label`),
    ``step`` and :func:`tokens_seen`. ``with_null=False`` skips ``null.jsonl``'s rows (their bootstrap
    costs; only the rank that writes needs them). ``intervention_kinds``: the centering intervention's
    scopes (``all``, ``layers``, ``site_classes``; none: not run). Call it on every rank: the statistics are all-reduced and
    FSDP2-sharded gains all-gathered."""
    norms = residual_norms(measure_kwargs.pop("norms", None) or find_norm_sites(model))
    energy = EnergyStatistics(len(norms), device=measure_kwargs.get("device") or "cpu")
    sites, stats, intervention = measure(model, ids, seq_len, references, norms=norms, energy=energy,
                                         intervention_kinds=intervention_kinds, **measure_kwargs)
    norm = record_norm_label(model, sites)
    seen = tokens_seen(step, tokens_per_step)
    where = {"model": model_name, "norm": norm, "step": step, "tokens_seen": seen}
    rows = statistics_rows(sites, stats, **where)
    null = (
        null_rows(sites, stats, **where, replicates=bootstrap_replicates, block=bootstrap_block, seed=seed)
        if with_null
        else []
    )
    changes = (
        intervention_rows(intervention, **where, replicates=bootstrap_replicates, block=bootstrap_block, seed=seed)
        if intervention is not None and with_null
        else []
    )
    return Records(
        sites=sites, stats=stats, rows=rows, null=null, norm=norm,
        energy=energy_rows(input_sites(norms), energy, **where),
        ellipsoid=ellipsoid_rows(norms, **where),
        intervention=changes,
    )
