"""normgeo from Python: ``normgeo.measure(model, texts_or_ids, **options)`` measures any torch model with
norms (a Hugging Face model, a TransformerLens ``HookedTransformer`` loaded without weight processing, or
one of our checkpoints, :func:`load_checkpoint`) as ``analyze.py`` does, through the same functions
(:mod:`normgeo.model_records`).

The options are the probe schema's fields (``normgeo.measure.probe_config.ProbeConfig``: ``tokens``, ``seed``,
``null_directions``, ``bootstrap={"replicates": ...}``, ``intervention``, ...) and ``analyze.py``'s
``model.seq_len``, ``model.batch_size`` and ``model.name`` (``AnalyzeModelSchema``), with their defaults,
types and checks: a bad one is refused by the schema's own check, in one line naming the field
(:class:`normgeo.config.schema.ConfigError`), as on the command line. ``tokens`` defaults to every token
given."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING, OmegaConf
from torch import nn

from corpus.sources import TextsSource, probe_documents
from corpus.tokenize import first_tokens, tiktoken_batch_encoder
from models.gpt import GPT
from models.pretrained import Loaded, hf_encoder, hf_forward, load_our_checkpoint
from normgeo.config.schema import AnalyzeModelSchema, ConfigError, check_intervention, check_types
from normgeo.measure.pipeline import AnalysisError
from normgeo.measure.probe_config import ProbeConfig
from normgeo.model_records import ModelRecords, measure_model, probe_setup

# ProbeConfig's keys of where analyze.py reads its text: measure is handed its text instead.
SOURCE_KEYS = ("source", "path", "plain_text_extensions", "encoding")
# AnalyzeModelSchema's keys that mean the same here (the model itself is an argument).
MODEL_KEYS = ("seq_len", "batch_size", "name")
SCRIPT = "analyze.py"  # whose --help lists the probe's keys, named by the schema's refusal of an unknown one


def option_names() -> list[str]:
    """Every option of :func:`measure`: fields of the probe schema and of analyze.py's model node."""
    return [f.name for f in dataclasses.fields(ProbeConfig) if f.name not in SOURCE_KEYS] + list(MODEL_KEYS)


def measure_options(options: dict[str, Any]) -> tuple[ProbeConfig, AnalyzeModelSchema]:
    """The options validated by the schema's own check; ConfigError (one line, naming the field)."""
    if given := [key for key in SOURCE_KEYS if key in options]:
        raise ConfigError(f"{given[0]}: not an option of normgeo.measure, which measures the texts or token "
                          "ids it is given (analyze.py reads probe.source)")
    model_options = {key: value for key, value in options.items() if key in MODEL_KEYS}
    probe_options = {key: value for key, value in options.items() if key not in MODEL_KEYS}
    probe = check_types(OmegaConf.create({"source": None, **probe_options}), ProbeConfig, SCRIPT)
    check_intervention(probe)
    spec = check_types(OmegaConf.create({"kind": "hf", **model_options}), AnalyzeModelSchema, SCRIPT)
    return probe, spec


def load_checkpoint(path: str | Path) -> Loaded:
    """One of our train.py checkpoints, ready for :func:`measure` (its step and tiktoken's gpt2 go along);
    ``.model`` is the GPT. ModelLoadError says what is wrong with the file."""
    return load_our_checkpoint(OmegaConf.create({"checkpoint": str(path), "dtype": "auto"}))


def is_transformer_lens(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformer_lens")


def processing_refusal(model: nn.Module) -> str | None:
    """Why a HookedTransformer's angles are not its model's, or None: TransformerLens' default processing
    folds the norms' gains away (``fold_ln``) and centres the writing weights, which makes the residual
    stream orthogonal to 1 whatever the model learned (models/export/lens.py)."""
    if model.cfg.normalization_type in ("LNPre", "RMSPre"):
        return (f"this HookedTransformer was loaded with fold_ln (normalization_type="
                f"{model.cfg.normalization_type}): load it with "
                "HookedTransformer.from_pretrained_no_processing")
    embedding = model.W_E.detach().float()
    if embedding.mean(-1).abs().max() <= 1e-6 * embedding.abs().mean():  # no trained embedding is centred
        return ("this HookedTransformer's writing weights were centred (center_writing_weights), which makes "
                "the residual stream orthogonal to 1: load it with "
                "HookedTransformer.from_pretrained_no_processing")
    return None


def as_loaded(model: nn.Module | Loaded, tokenizer: Any = None) -> Loaded:
    """The model with how to call it and tokenize for it. ``tokenizer``: a Hugging Face tokenizer or a
    tiktoken encoding's name; None: the model's own where it has one (ours: gpt2; TransformerLens': its
    ``tokenizer``)."""
    if isinstance(model, Loaded):
        loaded = model
    elif isinstance(model, GPT):
        encode, eot, _ = tiktoken_batch_encoder("gpt2")
        loaded = Loaded(model=model, forward=model, encode_batch=encode, separator=eot, source="python",
                        headless=model.hidden)
    elif is_transformer_lens(model):
        if refusal := processing_refusal(model):
            raise AnalysisError(refusal)
        tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        loaded = Loaded(model=model, forward=model, encode_batch=None, separator=None, source="python")
    else:
        loaded = Loaded(model=model, forward=hf_forward(model), encode_batch=None, separator=None,
                        source="python")
    if isinstance(tokenizer, str):
        encode, eot, _ = tiktoken_batch_encoder(tokenizer)
        return dataclasses.replace(loaded, encode_batch=encode, separator=eot)
    if tokenizer is not None:
        encode, separator = hf_encoder(tokenizer)
        return dataclasses.replace(loaded, encode_batch=encode, separator=separator)
    return loaded


def default_name(loaded: Loaded) -> str:
    """The records' model field when no ``name`` is given: the checkpoint, the Hub id, the model's name."""
    model = loaded.model
    if loaded.source != "python":
        return loaded.source
    if isinstance(model, GPT):
        return f"normgeo-{model.config.norm}"
    if is_transformer_lens(model):
        return model.cfg.model_name
    return Path(getattr(model.config, "name_or_path", "") or type(model).__name__).name


def probe_tokens(texts_or_ids: Any, loaded: Loaded, probe: ProbeConfig) -> tuple[np.ndarray, str, int | None]:
    """The token stream to measure, where it came from (run_info.json's probe_source) and a 2-D batch's
    width: texts tokenized as analyze.py tokenizes its documents (the seeded order,
    ``min_doc_tokens``/``max_doc_tokens``, a separator after each), or token ids as given (a 2-D batch
    row after row); the first ``tokens`` of them."""
    tokens = None if probe.tokens == MISSING else probe.tokens
    texts = [texts_or_ids] if isinstance(texts_or_ids, str) else texts_or_ids
    if isinstance(texts, Sequence) and texts and all(isinstance(text, str) for text in texts):
        if loaded.encode_batch is None:
            raise AnalysisError("texts need a tokenizer: pass tokenizer=<the model's Hugging Face tokenizer> "
                                "(or token ids)")
        source = TextsSource(texts)
        documents = probe_documents(source, sample=probe.sample, seed=probe.seed)
        try:
            return (first_tokens(documents, loaded.encode_batch, loaded.separator, tokens,
                                 min_tokens=probe.min_doc_tokens, max_tokens=probe.max_doc_tokens),
                    source.describe(), None)
        except ValueError as err:
            raise AnalysisError(f"{err}: lower tokens or give more text") from None
    ids = torch.as_tensor(texts_or_ids).cpu().numpy() if not isinstance(texts_or_ids, np.ndarray) \
        else texts_or_ids
    if ids.ndim not in (1, 2) or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise AnalysisError(f"texts_or_ids: expected texts, or token ids as a 1-D stream or a 2-D batch, "
                            f"not an array of shape {ids.shape} and dtype {ids.dtype}")
    width = ids.shape[1] if ids.ndim == 2 else None
    ids = ids.reshape(-1).astype(np.int64)
    if tokens is not None and tokens > len(ids):
        raise AnalysisError(f"tokens={tokens}: only {len(ids):,} token ids were given")
    return ids[:tokens], f"{len(ids):,} token ids given in Python", width


def measure(model: nn.Module | Loaded, texts_or_ids: Any, *, tokenizer: Any = None,
            **options: Any) -> ModelRecords:
    """The records ``analyze.py`` writes, of ``model`` on ``texts_or_ids`` (a text, texts, or token ids):
    ``.angles``, ``.null``, ``.energy``, ``.mean_sources``, ``.intervention`` as DataFrames, ``.plot()``,
    ``.save(folder)``. ``options``: :func:`option_names` (the probe schema's fields, see the module
    docstring); a 2-D batch of ids is measured in windows of its width unless ``seq_len`` is given.

        records = normgeo.measure(model, texts, tokenizer=tokenizer, tokens=4096, intervention=[])
        records.angles.query("ref == 'ones'")
    """
    probe_options, spec = measure_options(options)
    loaded = as_loaded(model, tokenizer)
    ids, probe_source, width = probe_tokens(texts_or_ids, loaded, probe_options)
    seq_len = width if width is not None and "seq_len" not in options else spec.seq_len
    probe = dataclasses.replace(probe_options, tokens=len(ids))  # the validated options are the probe's
    setup = probe_setup(loaded.model, probe, seq_len, "seq_len")
    name = spec.name or default_name(loaded)
    return measure_model(loaded.model, ids, setup, probe, batch_size=spec.batch_size, name=name,
                         source=loaded.source, probe_source=probe_source, step=loaded.step,
                         tokens_per_step=loaded.tokens_per_step, forward=loaded.forward,
                         headless=loaded.headless, separator=loaded.separator)
