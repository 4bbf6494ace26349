"""Inference-time geometry of a pretrained model: ``python analyze.py model=pythia-1.4b``.

Streams ``probe.tokens`` tokens of the probe corpus (1M of Wikipedia, as the paper) through the model,
tokenized by the model's own tokenizer, and measures the angle of every token vector with the uniform
vector 1, two random directions and K null directions before each norm (``.in``), after its
standardization (``.std``) and after it (``.out``). Writes to ``outputs/analyze/<model>/``:
``angles.jsonl``, ``null.jsonl`` (where 1 stands among the null directions), ``probe_references.npz``,
``figures/``, ``summary.csv``/``summary.md`` (pooled over tokens and layers) and ``run_info.json``.

    python analyze.py model=smollm2-135m probe=local probe.path=../shared/corpora/wikipedia
    python analyze.py model=hub model.path=EleutherAI/pythia-160m
    python analyze.py model=checkpoint model.checkpoint=outputs/1b-rms-s0/checkpoints/last.ckpt
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from corpus.atomic import atomic_write_json
from corpus.sources import SourceError, probe_documents
from corpus.stream import tokens_per_step
from corpus.tokenize import EncodeBatch, tiktoken_batch_encoder
from normgeo.analysis import (
    AnalysisError,
    hf_encoder,
    hf_forward,
    load_checkpoint,
    max_positions,
    measure,
    norm_kind,
    print_summary,
    probe_token_ids,
    summarize,
    write_summary,
)
from normgeo.config import ANALYZE_CONF_DIR, config_errors_exit_2
from normgeo.norm_sites import NoNormFoundError, find_norm_sites
from normgeo.pretrained import DTYPES, ModelLoadError, load_pretrained, minilm_path, smollm2_gguf_path
from normgeo.probe import make_references, residual_norms
from normgeo.records import (
    ANGLES_FILE,
    NULL_FILE,
    REFERENCES_FILE,
    null_rows,
    save_references,
    statistics_rows,
    write_step,
)
from normgeo.report import write_run_figures

log = logging.getLogger("normgeo.analyze")
RUN_INFO_FILE = "run_info.json"
# Models that ship inside pip packages, so they work offline: model.packaged=<key>.
PACKAGED: dict[str, Callable[[], tuple[str, str | None]]] = {
    "smollm2": lambda: ("", str(smollm2_gguf_path())),
    "minilm": lambda: (str(minilm_path()), None),
}


@dataclass
class Loaded:
    model: nn.Module
    forward: Callable[[torch.Tensor], object]
    encode_batch: EncodeBatch
    separator: int | None
    source: str  # what was loaded, for run_info.json
    step: int | None = None  # training step of our own checkpoints; None for released models
    tokens_per_step: int | None = None


def load_hf(spec: DictConfig) -> Loaded:
    if spec.get("packaged"):
        if spec.packaged not in PACKAGED:
            raise AnalysisError(f"model.packaged={spec.packaged!r}: choose one of {', '.join(PACKAGED)}")
        path, gguf_file = PACKAGED[spec.packaged]()
    else:
        path, gguf_file = spec.get("path"), spec.get("gguf_file")
        if OmegaConf.is_missing(spec, "gguf_file"):
            raise AnalysisError(
                "model.gguf_file is required with model=gguf: python analyze.py model=gguf "
                "model.gguf_file=/models/model.Q8_0.gguf (or model.path=<dir> model.gguf_file=<file in dir>)"
            )
        if OmegaConf.is_missing(spec, "path") or (not path and not gguf_file):
            raise AnalysisError(
                "model.path is required: python analyze.py model=hub model.path=<Hub id or local directory>, "
                "e.g. model.path=EleutherAI/pythia-1.4b, or pick a preset: model=pythia-1.4b"
            )
        if gguf_file and not path:
            # load_pretrained reads a bare .gguf name relative to `path`; without one, the working directory.
            gguf_file = str(Path(gguf_file).expanduser().resolve())
    model, tokenizer = load_pretrained(
        path or "",
        gguf_file=gguf_file,
        dtype=spec.dtype,
        device_map=spec.get("device_map"),
        trust_remote_code=spec.get("trust_remote_code", False),
        revision=spec.get("revision"),
    )
    encode_batch, separator = hf_encoder(tokenizer)
    source = str(Path(path or "", gguf_file or ""))
    return Loaded(model=model, forward=hf_forward(model), encode_batch=encode_batch, separator=separator,
                  source=source)


def load_our_checkpoint(spec: DictConfig) -> Loaded:
    if OmegaConf.is_missing(spec, "checkpoint") or not spec.checkpoint:
        raise AnalysisError(
            "model.checkpoint is required with model=checkpoint: "
            "model.checkpoint=<run_dir>/checkpoints/step-XXXXXXX.ckpt (or last.ckpt)"
        )
    model, step, hparams = load_checkpoint(spec.checkpoint)
    if DTYPES[spec.dtype] != "auto":
        model.to(DTYPES[spec.dtype])
    try:
        encode_batch, eot, _ = tiktoken_batch_encoder("gpt2")
    except RuntimeError as exc:  # no BPE files offline
        raise AnalysisError(str(exc)) from exc
    step_tokens = tokens_per_step(hparams["global_batch"], model.config.block_size) if "global_batch" in hparams else None
    return Loaded(model=model, forward=model, encode_batch=encode_batch, separator=eot,
                  source=str(Path(spec.checkpoint).resolve()), step=step, tokens_per_step=step_tokens)


def _device(cfg: DictConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def analyze(cfg: DictConfig) -> Path:
    """Measure one model and write its outputs; returns the output directory."""
    out_dir = Path(cfg.out_dir)
    started = time.perf_counter()
    loaded = load_our_checkpoint(cfg.model) if cfg.model.kind == "checkpoint" else load_hf(cfg.model)
    model = loaded.model
    if cfg.model.get("device_map"):
        device = None  # accelerate placed the layers; inputs go where the first parameter is
    else:
        device = _device(cfg)
        model.to(device)
    loaded_at = time.perf_counter()
    norms = find_norm_sites(model)
    kind = norm_kind(norms)
    dim = residual_norms(norms)[0].dim
    limit = max_positions(model)
    seq_len = min(cfg.model.seq_len, limit) if limit else cfg.model.seq_len
    params = sum(p.numel() for p in model.parameters())
    log.info("%s: %s params, %s norms (%s), d=%d, %s on %s, seq_len %d",
             cfg.model.name, f"{params:,}", len(norms), kind, dim, next(model.parameters()).dtype,
             device or "device_map", seq_len)

    source = instantiate(cfg.probe.source)
    try:
        documents = probe_documents(source, sample=cfg.probe.sample, seed=cfg.probe.seed)
    except SourceError as exc:
        raise AnalysisError(str(exc)) from exc
    ids = probe_token_ids(documents, loaded.encode_batch, loaded.separator, cfg.probe.tokens,
                          source.describe(), min_tokens=cfg.probe.min_doc_tokens)
    tokenized_at = time.perf_counter()
    references = make_references(dim, cfg.probe.seed, cfg.probe.null_directions)
    sites, stats = measure(
        model, ids, seq_len, references,
        forward=loaded.forward, norms=norms, batch_size=cfg.model.batch_size,
        include_standardized=cfg.probe.include_standardized, device=device, progress=cfg.progress,
    )
    measured_at = time.perf_counter()

    step = loaded.step
    # Released models: the number of probe tokens. Our checkpoints: training tokens, as the training probe.
    tokens_seen = len(ids) if step is None else (step * loaded.tokens_per_step if loaded.tokens_per_step else None)
    rows = statistics_rows(sites, stats, model=cfg.model.name, norm=kind, step=step, tokens_seen=tokens_seen)
    null = null_rows(sites, stats, model=cfg.model.name, norm=kind, step=step, tokens_seen=tokens_seen,
                     replicates=cfg.probe.bootstrap.replicates, block=cfg.probe.bootstrap.block,
                     seed=cfg.probe.seed)
    save_references(out_dir / REFERENCES_FILE, references)
    write_step(out_dir / ANGLES_FILE, rows)
    if null:
        write_step(out_dir / NULL_FILE, null)
    figures = write_run_figures(out_dir)
    summary = summarize(rows, null)
    write_summary(out_dir, summary)
    probe_seconds = measured_at - tokenized_at
    info = {
        "model": cfg.model.name,
        "source": loaded.source,
        "norm": kind,
        "params": params,
        "dim": dim,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(device or next(model.parameters()).device),
        "seq_len": seq_len,
        "batch_size": cfg.model.batch_size,
        "tokens": len(ids),
        "probe_source": source.describe(),
        "probe_sampled": bool(cfg.probe.sample),
        "probe_min_doc_tokens": cfg.probe.min_doc_tokens,
        "null_directions": cfg.probe.null_directions,
        "load_s": round(loaded_at - started, 2),
        "tokenize_s": round(tokenized_at - loaded_at, 2),
        "probe_s": round(probe_seconds, 2),
        "tokens_per_s": round(len(ids) / probe_seconds, 1),
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cuda_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }
    atomic_write_json(out_dir / RUN_INFO_FILE, info)
    print_summary(summary, title=f"{cfg.model.name}: angles before/after its norms ({len(ids):,} tokens)")
    log.info("probe: %s tokens in %.1f s (%.0f tokens/s); peak RSS %.0f MiB",
             f"{len(ids):,}", probe_seconds, info["tokens_per_s"], info["peak_rss_mib"])
    log.info("wrote %s, %s, %s, summary.csv/md and %d figure(s) to %s", ANGLES_FILE, NULL_FILE, REFERENCES_FILE,
             len(figures), out_dir)
    return out_dir


USER_ERRORS = (AnalysisError, ModelLoadError, NoNormFoundError, SourceError)


@hydra.main(config_path=ANALYZE_CONF_DIR, config_name="analyze", version_base="1.3")
def run(cfg: DictConfig) -> None:
    try:
        analyze(cfg)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


main = config_errors_exit_2(run)  # Hydra's own config errors exit 2 too (normgeo.config)

if __name__ == "__main__":
    main()
