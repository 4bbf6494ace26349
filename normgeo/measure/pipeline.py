"""The one measurement pipeline: (model, probe tokens, references) -> records.

The training callback (``callbacks/angle_probe.py``, every rank its share) and ``analyze.py`` (one
process) both call :func:`probe_ids` for the tokens and :func:`measure_records` for the records, so the
same checkpoint and tokens give the same records whichever measured them: one windowing rule
(:func:`windows`), one ``tokens_seen`` rule (:func:`tokens_seen`) and one ``include_standardized``
default (:data:`normgeo.measure.probe.INCLUDE_STANDARDIZED`). The norms are found once; every
measurement (:class:`normgeo.measure.measurement.Measurement`: angles, energy, ellipsoid, the centering
intervention) sees the same intact forward of each batch through :func:`run_probe`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function
from tqdm import tqdm

from corpus.refusal import Refusal
from corpus.sources import SourceError, probe_documents
from corpus.tokenize import EncodeBatch, first_tokens, tiktoken_batch_encoder
from models.gpt import GPT
from normgeo.measure.angles import AngleMeasurement
from normgeo.measure.ellipsoid import EllipsoidMeasurement
from normgeo.measure.energy import EnergyMeasurement, EnergyStatistics
from normgeo.measure.intervention import CenteringIntervention, eager, intervention_scopes
from normgeo.measure.mean_sources import MeanSourcesMeasurement, empty_buckets
from normgeo.measure.measurement import Measurement, ProbeBatch
from normgeo.measure.norm_sites import NormSite, find_norm_sites
from normgeo.measure.probe import INCLUDE_STANDARDIZED, ProbeSite, residual_norms
from normgeo.measure.probe_config import ProbeConfig
from normgeo.measure.stats import AngleStatistics
from normgeo.run_folder import (
    ANGLES_FILE,
    ENERGY_FILE,
    INTERVENTION_FILE,
    MEAN_SOURCES_FILE,
    NULL_FILE,
)

log = logging.getLogger(__name__)
# The profiler label around run_probe's batches (bench/gpu_profile.py counts the host syncs under it).
PROBE_SCOPE = "normgeo.run_probe"


class AnalysisError(Refusal, RuntimeError):
    """A user error in a measurement (bad config, too small a corpus); the message says what to fix."""


def probe_ids(source, encode_batch: EncodeBatch, separator: int | None, probe: ProbeConfig) -> np.ndarray:
    """The first ``probe.tokens`` token ids of the source's
    documents in its seeded sampling order (those under
    ``probe.min_doc_tokens`` skipped, the rest cut to their first ``probe.max_doc_tokens``); an
    :class:`AnalysisError` saying what to change if there are fewer."""
    if probe.tokens <= 0:
        raise AnalysisError(f"probe.tokens must be positive, not {probe.tokens}")
    try:
        documents = probe_documents(source, sample=probe.sample, seed=probe.seed)
        return first_tokens(documents, encode_batch, separator, probe.tokens, min_tokens=probe.min_doc_tokens,
                            max_tokens=probe.max_doc_tokens)
    except SourceError as exc:  # a ValueError too, but about reading the corpus, not its size
        raise AnalysisError(
            f"{exc} Or probe a local copy of the text: probe=local probe.path=<folder or file>"
        ) from exc
    except ValueError as exc:
        raise AnalysisError(
            f"{exc} ({source.describe()}): lower probe.tokens or give a larger corpus"
        ) from exc


def tiktoken_probe_ids(source, probe: ProbeConfig, tokenizer: str = "gpt2") -> np.ndarray:
    """:func:`probe_ids` with a tiktoken encoding: the training probe's tokens, computed once by train.py's
    start check (normgeo.runs.start) and handed to the probe callback."""
    encode, eot, _ = tiktoken_batch_encoder(tokenizer)
    return probe_ids(source, encode, eot, probe)


def tiktoken_separator(tokenizer: str = "gpt2") -> int:
    """The separator :func:`tiktoken_probe_ids` puts after each document: the encoding's end-of-text."""
    return tiktoken_batch_encoder(tokenizer)[1]


def document_starts(ids: np.ndarray | torch.Tensor, separator: int | None) -> np.ndarray | None:
    """Which tokens of the probe stream ``ids`` begin a document (bool, one per token), None without a
    separator. :func:`probe_ids` puts the separator after each document (``first_tokens``), so the stream
    opens with its first document's first token: a document begins at the first token, unless that is a
    separator, and at every token after a separator that is not itself one."""
    if separator is None:
        return None
    ids = np.asarray(ids)
    is_separator = ids == separator
    starts = ~is_separator
    starts[1:] &= is_separator[:-1]
    return starts


def document_index(starts: np.ndarray) -> np.ndarray:
    """Which document of the probe stream each token belongs to (0, 1, ...), from :func:`document_starts`:
    a separator is the document's it closes, and a stream that opens with one gives it to document 0."""
    return np.maximum(np.cumsum(starts, dtype=np.int64) - 1, 0)


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


def budget_windows(parts: Sequence[torch.Tensor], token_budget: int | None) -> tuple[int, int]:
    """(windows, tokens) of the first ``token_budget`` probe tokens in whole windows (all of them for None):
    the windows that start before the budget, in the global order of :func:`windows`."""
    count = tokens = 0
    for part in parts:
        for _ in range(len(part)):
            if token_budget is not None and tokens >= token_budget:
                return count, tokens
            count, tokens = count + 1, tokens + part.shape[1]
    return count, tokens


def probe_batches(parts: Sequence[torch.Tensor], batch_size: int, rank: int = 0, world_size: int = 1
                  ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """This rank's probe batches: (global ids of its real rows, its windows padded to the largest share,
    ``lead_id``: the smallest global id any rank holds in the batch, the same on every rank)."""
    batches = []
    first = 0
    for part in parts:
        ids = torch.arange(first, first + len(part))[rank::world_size]
        share = part[rank::world_size]
        padded = math.ceil(len(part) / world_size)
        if padded > len(share):
            share = torch.cat([share, share.new_zeros((padded - len(share), part.shape[1]))])
        batches += [
            (ids[start : start + batch_size], share[start : start + batch_size], first + world_size * start)
            for start in range(0, padded, batch_size)
        ]
        first += len(part)
    return batches


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def run_probe(
    model: nn.Module,
    parts: Sequence[torch.Tensor],
    measurements: Sequence[Measurement],
    *,
    norms: Sequence[NormSite],
    document_starts: Sequence[torch.Tensor] | None = None,
    documents: Sequence[torch.Tensor] | None = None,
    forward: Callable[[torch.Tensor], object] | None = None,
    headless: Callable[[torch.Tensor], object] | None = None,
    batch_size: int = 8,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    device: torch.device | str | None = None,
    progress: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> None:
    """Stream the probe windows ``parts`` (each (n, T), as :func:`windows` cuts them)
    through ``model`` once and hand every measurement each batch
    (:mod:`normgeo.measure.measurement`: ``before_batch``, ``observe_norm`` in the
    intact forward through one hook per norm of ``norms``, ``observe_batch`` after it).

    Rank ``rank`` of ``world_size`` runs windows ``rank, rank + world_size, ...`` of each part, padded to as
    many forwards as the largest share (a sharded model's all-gathers are collective); padding rows are never
    measured. Nothing is all-reduced here. ``forward`` defaults to ``model(batch)``; ``headless`` (None:
    ``forward``) is the intact forward of the batches whose output no measurement reads
    (:meth:`Measurement.reads_output`): the model without its LM head. ``autocast`` gives the precision.
    ``progress``: a bar in forwards (the intervention's included), which moves within a batch, with the time
    left over the whole probe and the probe tokens measured per second.
    ``document_starts``: bool windows of the shapes of ``parts`` (:func:`document_starts` cut by
    :func:`windows`), handed to every batch as :attr:`ProbeBatch.document_starts`; ``documents`` likewise
    (:func:`document_index` cut by :func:`windows`) as :attr:`ProbeBatch.documents`.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    call = forward or (lambda batch: model(batch))
    batches = probe_batches(parts, batch_size, rank, world_size)

    def on_device(masks: Sequence[torch.Tensor] | None) -> list[torch.Tensor | None]:
        """Per batch, ``masks`` cut like the tokens, on the device once for the whole probe (a batch's
        slice there: no copy from the host per batch)."""
        if masks is None:
            return [None] * len(batches)
        cut = probe_batches([m.to(device) for m in masks], batch_size, rank, world_size)
        return [rows for _, rows, _ in cut]

    starts, numbers = on_device(document_starts), on_device(documents)
    total = sum(1.0 + sum(m.forwards_per_batch(lead_id) for m in measurements) for _, _, lead_id in batches)
    current: list[ProbeBatch | None] = [None]  # the batch being measured; None while other forwards run

    def make_hook(index: int, norm: NormSite) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor | tuple) -> None:
            batch = current[0]
            if batch is None or batch.rows == 0:
                return
            out = (output[0] if isinstance(output, tuple) else output)[: batch.rows]
            for measurement in measurements:
                measurement.observe_norm(index, norm, inputs[0][: batch.rows], out, batch)

        return hook

    handles = [norm.module.register_forward_hook(make_hook(i, norm)) for i, norm in enumerate(norms)]
    # Redrawn at every forward (a few hundred per probe at most), so a slow model's bar moves within a batch.
    # The time left is in forwards, the intervention's counted: it holds over the whole probe.
    bar = tqdm(total=round(total, 2), desc="probe", unit="fwd", disable=not progress, mininterval=0,
               miniters=1,
               bar_format="{l_bar}{bar}| {n:.1f}/{total_fmt} forwards [{elapsed}<{remaining}{postfix}]")
    started = time.perf_counter()
    measured = 0  # this rank's probe tokens whose batches (intervention included) are done
    try:
        with contextlib.ExitStack() as stack:
            for measurement in measurements:
                stack.enter_context(measurement)
            stack.enter_context(eval_mode(model))
            # A compiled model (compile=true) is probed eagerly: Dynamo does not guard on forward hooks
            # (torch._dynamo.config.skip_nnmodule_hook_guards), so a graph traced without the probe's hooks,
            # or with an earlier probe's, would be replayed and the norms left unobserved (count 0).
            stack.enter_context(eager())
            stack.enter_context(record_function(PROBE_SCOPE))  # a profile's probe ops, records apart
            stack.enter_context(torch.no_grad())
            stack.enter_context(autocast())
            stack.enter_context(bar)
            for number, (ids, tokens, lead_id) in enumerate(batches):
                rows = len(ids)
                batch = ProbeBatch(tokens=tokens.to(device, non_blocking=True), rows=rows, sequence_ids=ids,
                                   lead_id=lead_id, forward=call, progress=bar.update,
                                   document_starts=starts[number], documents=numbers[number])
                for measurement in measurements:
                    measurement.before_batch(batch)
                current[0] = batch
                read = headless is None or any(m.reads_output(lead_id) for m in measurements)
                batch.output = (call if read else headless)(batch.tokens)
                current[0] = None  # the measurements' own forwards are not observed
                bar.update(1)
                for measurement in measurements:
                    measurement.observe_batch(batch)
                batch.output = None  # the logits of a batch can be GBs: gone before the next forward
                measured += rows * tokens.shape[1]
                rate = measured / (time.perf_counter() - started)
                bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
                if number == 0 and progress and len(batches) > 1:
                    done = 1.0 + sum(m.forwards_per_batch(lead_id) for m in measurements)
                    log.info("probe: the first batch took %.1f s; the probe will take about %s",
                             time.perf_counter() - started,
                             tqdm.format_interval((time.perf_counter() - started) * total / done))
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class Records:
    """What one measurement yields: the probe's sites and angle statistics, the norm label, and the rows of
    every file the measurements write (``angles.jsonl``, ``null.jsonl`` if asked for, ``energy.jsonl``,
    ``ellipsoid.jsonl``, ``intervention.jsonl`` and ``mean_sources.jsonl`` if asked for)."""

    sites: list[ProbeSite]
    stats: AngleStatistics
    norm: str
    files: dict[str, list[dict]]

    @property
    def rows(self) -> list[dict]:
        return self.files[ANGLES_FILE]

    @property
    def null(self) -> list[dict]:
        return self.files.get(NULL_FILE, [])

    @property
    def energy(self) -> list[dict]:
        return self.files[ENERGY_FILE]

    @property
    def intervention(self) -> list[dict]:
        return self.files.get(INTERVENTION_FILE, [])


def record_norm_label(model: nn.Module, sites: Sequence[ProbeSite]) -> str:
    """The ``norm`` field of the records: our GPT's configured arm (``layer_nobias`` and ``rms_bias`` are
    LayerNorm and RMSNorm modules too), else the kind found in the model."""
    return model.config.norm if isinstance(model, GPT) else norm_kind(sites)


def announce(parts: Sequence[torch.Tensor], batch_size: int, world_size: int,
             intervention: CenteringIntervention | None) -> None:
    """Before the probe starts: its forwards per batch and in all, the intervention's share said."""
    batches = [lead for _, _, lead in probe_batches(parts, batch_size, 0, world_size)]
    tokens = sum(part.numel() for part in parts)
    if intervention is None:
        log.info("probe: %s tokens, %d forward(s) of up to %d x %d per rank; no centering intervention",
                 f"{tokens:,}", len(batches), batch_size, parts[0].shape[1])
        return
    extra = [intervention.forwards_per_batch(lead) for lead in batches]
    intervened = sum(1 for cost in extra if cost)
    resumed = sum(1 for scope in intervention.scopes if intervention.resume_layer(scope) is not None)
    log.info(
        "probe: %s tokens, %d batch(es) of up to %d x %d per rank; the centering intervention on the first "
        "%s tokens (%d batch(es)): %d scope forward(s) per batch (%d resumed mid-stack), about %.1f forwards "
        "per batch there; %.1f forwards in all, %.1fx the angle probe alone",
        f"{tokens:,}", len(batches), batch_size, parts[0].shape[1], f"{intervention.token_budget:,}",
        intervened, len(intervention.scopes), resumed, 1 + max(extra), len(batches) + sum(extra),
        (len(batches) + sum(extra)) / len(batches),
    )


def measure_records(
    model: nn.Module,
    ids: np.ndarray | torch.Tensor,
    seq_len: int,
    references: dict[str, np.ndarray],
    probe: ProbeConfig,
    *,
    batch_size: int,
    model_name: str,
    step: int | None,
    tokens_per_step: int | None,
    with_null: bool = True,
    norms: Sequence[NormSite] | None = None,
    forward: Callable[[torch.Tensor], object] | None = None,
    headless: Callable[[torch.Tensor], object] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    device: torch.device | str | None = None,
    progress: bool = False,
    rank: int = 0,
    world_size: int = 1,
    announce_cost: bool = False,
    resume_mid_stack: bool = True,
    separator: int | None = None,
) -> Records:
    """Every measurement ``probe`` asks for on ``ids`` cut by :func:`windows` (forwards of ``batch_size``
    sequences), merged over ranks, as records.

    The records carry ``model_name``, the model's norm (:func:`record_norm_label`), ``step`` and
    :func:`tokens_seen`. ``with_null=False`` skips the rows whose bootstrap costs (``null.jsonl``,
    ``intervention.jsonl``; only the rank that writes needs them). The centering intervention runs its
    ``probe.intervention`` scopes (none: not run) on the first ``probe.intervention_tokens`` probe tokens in
    whole windows; ``headless`` (:func:`run_probe`) runs the other batches without the LM head.
    ``announce_cost``: log the forwards the probe will run before it starts.
    ``resume_mid_stack=False`` re-runs every per-block scope's forward from the embeddings (what the resumed
    forwards are tested and benchmarked against). ``separator``: the token :func:`probe_ids` put between
    the documents of ``ids``, from which the document starts are found (:func:`document_starts`; None: not
    known, and ``mean_sources.jsonl``'s and ``intervention_positions.jsonl``'s ``doc_start`` rows are
    empty). Call it on every rank: the statistics are all-reduced and FSDP2-sharded gains all-gathered.
    """
    parts = windows(ids, seq_len)
    if not parts:
        raise AnalysisError("no probe tokens to measure")
    starts = document_starts(ids, separator)
    start_parts = [w.bool() for w in windows(starts, seq_len)] if starts is not None else None
    index = document_index(starts) if starts is not None else None
    document_parts = windows(index, seq_len) if index is not None else None
    num_sequences = sum(len(part) for part in parts)
    norms = residual_norms(list(norms) if norms is not None else find_norm_sites(model))
    where = torch.device(device) if device is not None else next(model.parameters()).device
    angles = AngleMeasurement(
        norms, references, num_sequences=num_sequences, device=where,
        include_standardized=probe.include_standardized, with_null=with_null,
        bootstrap_replicates=probe.bootstrap.replicates, bootstrap_block=probe.bootstrap.block,
        seed=probe.seed)
    measurements: list[Measurement] = [angles, EnergyMeasurement(norms, device=where),
                                       EllipsoidMeasurement(norms)]
    if probe.mean_sources:
        measurements.append(MeanSourcesMeasurement(
            norms, device=where, documents=int(index[-1]) + 1 if index is not None else 0,
            bootstrap_replicates=probe.bootstrap.replicates, seed=probe.seed))
        longest = max(part.shape[1] for part in parts)
        if announce_cost and (empty := empty_buckets(longest)):  # valid, and the run goes on: said once
            log.warning("probe windows of %d tokens: %s's position bucket(s) %s hold no tokens (count 0); "
                        "a longer seq_len (analyze.py: model.seq_len) reaches them", longest,
                        MEAN_SOURCES_FILE, ", ".join(empty))
    scopes = intervention_scopes(norms, probe.intervention) if probe.intervention else []
    intervention = None
    if scopes:
        budget, budget_tokens = budget_windows(parts, probe.intervention_tokens)
        intervention = CenteringIntervention(
            model, norms, scopes, budget, token_budget=budget_tokens, device=where, with_rows=with_null,
            resume=resume_mid_stack, bootstrap_replicates=probe.bootstrap.replicates,
            bootstrap_block=probe.bootstrap.block, seed=probe.seed)
        measurements.append(intervention)
    if announce_cost:
        announce(parts, batch_size, world_size, intervention)
    run_probe(model, parts, measurements, norms=norms, document_starts=start_parts, documents=document_parts,
              forward=forward, headless=headless, batch_size=batch_size, autocast=autocast, device=device,
              progress=progress, rank=rank, world_size=world_size)
    for measurement in measurements:
        measurement.all_reduce()
    norm = record_norm_label(model, angles.sites)
    keys = {"model": model_name, "norm": norm, "step": step,
            "tokens_seen": tokens_seen(step, tokens_per_step)}
    files: dict[str, list[dict]] = {}
    for measurement in measurements:
        files.update(measurement.records(keys))
    return Records(sites=angles.sites, stats=angles.stats, norm=norm, files=files)


def probe_angles(
    model: nn.Module,
    sequences: torch.Tensor,
    references: dict[str, np.ndarray],
    *,
    norms: Sequence[NormSite] | None = None,
    energy: EnergyStatistics | None = None,
    include_standardized: bool = INCLUDE_STANDARDIZED,
    **probe_options,
) -> tuple[list[ProbeSite], AngleStatistics]:
    """The angle statistics (and, into ``energy``, the energy along 1) of ``sequences`` (n, T) on one process:
    :func:`run_probe` with the angle measurement alone, not all-reduced, for tests and benchmarks."""
    norms = residual_norms(list(norms) if norms is not None else find_norm_sites(model))
    device = probe_options.get("device") or next(model.parameters()).device
    angles = AngleMeasurement(norms, references, num_sequences=len(sequences), device=device,
                              include_standardized=include_standardized)
    measurements: list[Measurement] = [angles]
    if energy is not None:
        measurements.append(EnergyMeasurement(norms, stats=energy))
    run_probe(model, [sequences], measurements, norms=norms, **probe_options)
    return angles.sites, angles.stats
