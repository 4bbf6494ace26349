"""find_norm_sites on tiny randomly initialized transformers models, our GPT, and two real checkpoints."""

from __future__ import annotations

import os

# Before transformers/huggingface_hub are imported: they read these once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
import transformers
from torch import nn

from models.gpt import GPT, GPTConfig
from normgeo.measure.norm_sites import NoNormFoundError, NormSite, find_norm_sites

D = 32
TINY = {"num_hidden_layers": 2, "hidden_size": D, "num_attention_heads": 2, "intermediate_size": 64}
DECODER = {**TINY, "num_key_value_heads": 2, "vocab_size": 128}


def pre_norm(kind: str, n_layer: int = 2, second: bool = True) -> list[tuple[int | str, str, str]]:
    roles = ("ln1", "ln2") if second else ("ln1",)
    return [(i, role, kind) for i in range(n_layer) for role in roles] + [("final", "final", kind)]


def post_norm_bert(n_layer: int) -> list[tuple[int | str, str, str]]:
    blocks = [(i, role, "layer") for i in range(n_layer) for role in ("attn_out", "mlp_out")]
    return [("embed", "embed", "layer"), *blocks]


def labels(sites: list[NormSite]) -> list[tuple[int | str, str, str]]:
    return [(s.layer, s.role, s.kind) for s in sites]


def assert_unique(sites: list[NormSite]) -> None:
    keys = [(s.layer, s.role) for s in sites]
    assert len(keys) == len(set(keys)), keys


def tiny(config: transformers.PretrainedConfig) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config)


EPS = 3e-4  # not any default, so a site's eps must come from the config


# arch: (config factory, expected (layer, role, kind) labels, expected eps)
HF_CASES = {
    "gpt2": (
        lambda: transformers.GPT2Config(
            n_layer=2, n_embd=D, n_head=2, vocab_size=128, layer_norm_epsilon=EPS
        ),
        pre_norm("layer"),
        EPS,
    ),
    "gpt_neox": (
        lambda: transformers.GPTNeoXConfig(**TINY, vocab_size=128, layer_norm_eps=EPS),
        pre_norm("layer"),
        EPS,
    ),
    "llama": (lambda: transformers.LlamaConfig(**DECODER, rms_norm_eps=EPS), pre_norm("rms"), EPS),
    "qwen2": (lambda: transformers.Qwen2Config(**DECODER, rms_norm_eps=EPS), pre_norm("rms"), EPS),
    "gemma": (
        lambda: transformers.GemmaConfig(**DECODER, head_dim=16, rms_norm_eps=EPS),
        pre_norm("rms"),
        EPS,
    ),
    # Parallel attention + MLP: one norm per block.
    "gptj": (
        lambda: transformers.GPTJConfig(
            n_layer=2, n_embd=D, n_head=2, rotary_dim=8, vocab_size=128, layer_norm_epsilon=EPS
        ),
        pre_norm("layer", second=False),
        EPS,
    ),
    "gpt_neo": (
        lambda: transformers.GPTNeoConfig(
            num_layers=2,
            hidden_size=D,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            vocab_size=128,
            layer_norm_epsilon=EPS,
        ),
        pre_norm("layer"),
        EPS,
    ),
    "bert": (
        lambda: transformers.BertConfig(**TINY, vocab_size=128, layer_norm_eps=EPS),
        post_norm_bert(2),
        EPS,
    ),
    # OlmoLayerNorm: no parameters, eps hard-coded in its forward.
    "olmo": (lambda: transformers.OlmoConfig(**DECODER), pre_norm("layer"), 1e-5),
}


@pytest.mark.parametrize("arch", sorted(HF_CASES))
def test_transformers_architectures(arch: str) -> None:
    make_config, expected, eps = HF_CASES[arch]
    model = tiny(make_config())
    sites = find_norm_sites(model)
    assert labels(sites) == expected
    assert_unique(sites)
    assert all(s.dim == D and s.eps == pytest.approx(eps, rel=1e-6) for s in sites)
    modules = dict(model.named_modules())
    assert all(modules[s.name] is s.module for s in sites)


def test_names_of_gpt2_and_bert() -> None:
    gpt2 = find_norm_sites(tiny(transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=128)))
    assert [s.name for s in gpt2] == ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"]
    bert = find_norm_sites(tiny(transformers.BertConfig(**TINY, vocab_size=128)))
    assert bert[0].name == "embeddings.LayerNorm" and bert[0].eps == 1e-12
    assert bert[1].name == "encoder.layer.0.attention.output.LayerNorm"
    assert bert[2].name == "encoder.layer.0.output.LayerNorm"


def test_wrapped_model_and_head_norm() -> None:
    # A causal-LM wrapper adds a prefix; BERT's MLM head adds a norm after the encoder.
    llama = find_norm_sites(transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)))
    assert labels(llama) == pre_norm("rms")
    assert llama[0].name == "model.layers.0.input_layernorm" and llama[-1].name == "model.norm"
    bert = find_norm_sites(transformers.BertForMaskedLM(transformers.BertConfig(**TINY, vocab_size=128)))
    assert labels(bert) == [*post_norm_bert(2), ("final", "final", "layer")]
    assert bert[-1].name == "cls.predictions.transform.LayerNorm"


def test_gemma2_post_sublayer_norms_keep_their_names() -> None:
    # post_attention_layernorm normalizes the attention output
    # here; pre_feedforward_layernorm is the pre-MLP norm.
    sites = find_norm_sites(tiny(transformers.Gemma2Config(**DECODER, head_dim=16)))
    block = ["ln1", "post_attention_layernorm", "ln2", "post_feedforward_layernorm"]
    assert labels(sites) == [(i, role, "rms") for i in range(2) for role in block] + [
        ("final", "final", "rms")
    ]


def test_qwen3_head_norms_inside_attention() -> None:
    sites = find_norm_sites(tiny(transformers.Qwen3Config(**DECODER, head_dim=16)))
    block = [("q_norm", 16), ("k_norm", 16), ("ln1", D), ("ln2", D)]
    expected = [(i, role, "rms", dim) for i in range(2) for role, dim in block] + [
        ("final", "final", "rms", D)
    ]
    assert [(s.layer, s.role, s.kind, s.dim) for s in sites] == expected


def test_t5_is_rms_and_labels_stay_unique() -> None:
    config = transformers.T5Config(num_layers=2, d_model=D, num_heads=2, d_ff=64, d_kv=16, vocab_size=128)
    sites = find_norm_sites(tiny(config))
    assert len(sites) == 2 * 2 + 1 + 2 * 3 + 1
    assert {s.kind for s in sites} == {"rms"}  # T5LayerNorm does not subtract the mean
    assert_unique(sites)
    roles = {(s.layer, s.role) for s in sites}
    assert {
        (0, "encoder.layer.0.layer_norm"),
        (0, "decoder.layer.1.layer_norm"),
        (1, "layer.2.layer_norm"),
    } <= roles
    assert {("final", "encoder.final_layer_norm"), ("final", "decoder.final_layer_norm")} <= roles


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_normgeo_gpt(kind: str) -> None:
    model = GPT(GPTConfig(norm=kind, n_embd=D, n_head=2, n_layer=3, vocab_size=100, norm_eps=1e-6))
    sites = find_norm_sites(model)
    assert labels(sites) == pre_norm(kind, n_layer=3)
    assert [s.name for s in sites[:2]] == ["blocks.0.ln1", "blocks.0.ln2"] and sites[-1].name == "ln_f"
    assert all(s.eps == 1e-6 and s.dim == D for s in sites)


class WrappedLayerNorm(nn.Module):
    """A norm made of a norm: only the outer one is a site; eps and dim come from the inner one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim, eps=1e-3, elementwise_affine=False)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x) * self.gamma


class FakeEncoderLayerStableLayerNorm(nn.Module):
    """Named like a norm (as in Wav2Vec2) but a whole layer: not a site, its own norm is."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb_norm = WrappedLayerNorm(8)
        self.layers = nn.ModuleList(FakeEncoderLayerStableLayerNorm(8) for _ in range(2))
        self.head_norm = nn.RMSNorm(8)  # eps=None: torch uses the dtype's machine epsilon


def test_nesting_lookalikes_and_default_eps() -> None:
    sites = find_norm_sites(Toy())
    assert [(s.name, s.layer, s.role, s.kind) for s in sites] == [
        ("emb_norm", "embed", "embed", "layer"),
        ("layers.0.layer_norm", 0, "layer_norm", "layer"),
        ("layers.1.layer_norm", 1, "layer_norm", "layer"),
        ("head_norm", "final", "final", "rms"),
    ]
    assert sites[0].eps == 1e-3 and sites[0].dim == 8
    assert sites[-1].eps == torch.finfo(torch.float32).eps


def test_norm_site_equality_ignores_the_module() -> None:
    a, b = nn.LayerNorm(4), nn.LayerNorm(4)
    site = NormSite("x", 0, "ln1", "layer", 1e-5, 4, a)
    assert site == NormSite("x", 0, "ln1", "layer", 1e-5, 4, b)
    assert len({site, NormSite("x", 0, "ln1", "layer", 1e-5, 4, b)}) == 1
    assert "module" not in repr(site)


def test_no_norm_raises_with_module_classes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(NoNormFoundError) as info:
        find_norm_sites(model)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "Sequential" in message and "'Linear'" in message and "'ReLU'" in message
    assert "norms=" in message


# Real checkpoints: every norm module is found and labelled.


def all_norm_like_modules(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "Norm" in type(m).__name__]


@pytest.fixture(scope="module")
def smollm2(smollm2_model_and_tokenizer) -> nn.Module:
    return smollm2_model_and_tokenizer[0]


@pytest.fixture(scope="module")
def minilm(minilm_model_and_tokenizer) -> nn.Module:
    return minilm_model_and_tokenizer[0]


@pytest.mark.slow
def test_smollm2_sites(smollm2: nn.Module) -> None:
    sites = find_norm_sites(smollm2)
    assert smollm2.config.num_hidden_layers == 30
    assert labels(sites) == pre_norm("rms", n_layer=30)
    assert [s.name for s in sites] == all_norm_like_modules(smollm2)
    assert sites[1].name == "layers.0.post_attention_layernorm" and sites[-1].name == "norm"
    assert all(s.eps == smollm2.config.rms_norm_eps and s.dim == 576 for s in sites)
    assert smollm2.config.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.slow
def test_minilm_sites(minilm: nn.Module) -> None:
    sites = find_norm_sites(minilm)
    assert labels(sites) == post_norm_bert(6)
    assert [s.name for s in sites] == all_norm_like_modules(minilm)
    assert all(s.eps == minilm.config.layer_norm_eps == 1e-12 and s.dim == 384 for s in sites)
