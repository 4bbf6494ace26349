"""normgeo's GPT -> a Hugging Face ``transformers`` model, with the same logits.

Which class holds which arm exactly:

- Pre-LN ``layer`` and ``layer_nobias`` -> ``GPT2LMHeadModel``: the same block (LN -> attention, residual;
  LN -> GELU-tanh MLP, residual), learned positions, a final LN. A LayerNorm without bias is GPT-2's with a
  zero bias; GPT-2's ``Conv1D`` stores ``nn.Linear``'s weight transposed; ``activation_function`` is
  ``gelu_pytorch_tanh`` (``F.gelu(approximate="tanh")``, the harness's GELU); an untied head is
  ``tie_word_embeddings=False``.
- Everything else (RMSNorm, RMSNorm + bias, DyT, and every Post-LN arm) -> :mod:`models.export.modeling_normgeo`,
  saved beside the weights and loaded with ``trust_remote_code=True``. No built-in class has RMSNorm or DyT
  with learned absolute positions; ``OPTForCausalLM`` (``do_layer_norm_before=False``) is post-LN but builds
  no final LayerNorm in that mode, while the harness's Post-LN model applies ``ln_f`` before the head (and
  OPT's positions are offset by 2), so OPT cannot hold it exactly.

The vocabulary keeps the harness's padded size (50257 rounded up to a multiple of 64 = 50304): the padded
rows are part of the softmax the model was trained and validated with, so the exported log-probabilities
over the real 50257 tokens are the harness's to the last bit; a tokenizer never emits the padded ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from models.gpt import GPT

GPT2_ARMS = ("layer", "layer_nobias")  # pre-LN only


def holds_as_gpt2(gpt: GPT) -> bool:
    """True if ``GPT2LMHeadModel`` holds this model exactly (pre-LN LayerNorm, with or without bias)."""
    return gpt.config.placement == "pre" and gpt.config.norm in GPT2_ARMS


def hf_class_name(gpt: GPT) -> str:
    return "GPT2LMHeadModel" if holds_as_gpt2(gpt) else "NormGeoForCausalLM"


def _weights(gpt: GPT) -> dict[str, torch.Tensor]:
    """The model's tensors in float32, each once (a tied head is the embedding)."""
    state = {name: tensor.detach().float().clone() for name, tensor in gpt.state_dict().items()}
    if gpt.config.tie_embeddings:
        state.pop("lm_head.weight")
    return state


def _gpt2_state_dict(gpt: GPT) -> dict[str, torch.Tensor]:
    cfg = gpt.config
    source = _weights(gpt)
    zeros = lambda n: torch.zeros(n)  # noqa: E731 - a bias GPT-2 always has and an arm may lack
    state = {"transformer.wte.weight": source["wte.weight"], "transformer.wpe.weight": source["wpe.weight"]}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for norm, hf_norm in (("ln1", "ln_1"), ("ln2", "ln_2")):
            state[f"{theirs}{hf_norm}.weight"] = source[f"{ours}{norm}.weight"]
            state[f"{theirs}{hf_norm}.bias"] = source.get(f"{ours}{norm}.bias", zeros(cfg.n_embd))
        for linear in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            weight = source[f"{ours}{linear}.weight"]
            state[f"{theirs}{linear}.weight"] = weight.t().contiguous()  # Conv1D: (in, out)
            state[f"{theirs}{linear}.bias"] = source.get(f"{ours}{linear}.bias", zeros(weight.shape[0]))
    state["transformer.ln_f.weight"] = source["ln_f.weight"]
    state["transformer.ln_f.bias"] = source.get("ln_f.bias", zeros(cfg.n_embd))
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = source["lm_head.weight"]
    return state


def _gpt2(gpt: GPT) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = gpt.config
    config = GPT2Config(
        vocab_size=cfg.padded_vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * cfg.n_embd, activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1,
    )
    model = GPT2LMHeadModel(config)
    model.load_state_dict(_gpt2_state_dict(gpt), strict=not cfg.tie_embeddings)
    return model


def _normgeo(gpt: GPT) -> nn.Module:
    from models.export.modeling_normgeo import NormGeoConfig, NormGeoForCausalLM, NormGeoModel

    cfg = gpt.config
    NormGeoConfig.register_for_auto_class()
    NormGeoForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    config = NormGeoConfig(
        vocab_size=cfg.padded_vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, norm=cfg.norm, norm_eps=cfg.norm_eps, placement=cfg.placement, bias=cfg.bias,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1,
    )
    model = NormGeoForCausalLM(config)
    # save_pretrained records the saved class only; AutoModel (the base model analyze.py measures) is added.
    model.config.auto_map = {"AutoConfig": "modeling_normgeo.NormGeoConfig",
                             "AutoModel": f"modeling_normgeo.{NormGeoModel.__name__}",
                             "AutoModelForCausalLM": "modeling_normgeo.NormGeoForCausalLM"}
    state = {(k if k.startswith("lm_head.") else f"transformer.{k}"): v for k, v in _weights(gpt).items()}
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    return model


def to_hf(gpt: GPT) -> nn.Module:
    """The ``transformers`` causal LM (float32, eval mode) whose logits are ``gpt``'s."""
    model = _gpt2(gpt) if holds_as_gpt2(gpt) else _normgeo(gpt)
    if gpt.config.tie_embeddings:
        model.tie_weights()
    if gpt.config.tie_embeddings != (model.lm_head.weight is model.get_input_embeddings().weight):
        raise RuntimeError("the exported head's tying differs from the harness model's")
    return model.float().eval()


def save_hf(gpt: GPT, out_dir: Path) -> None:
    """``model.safetensors`` and ``config.json`` (plus the model code where no built-in class holds the arm)."""
    to_hf(gpt).save_pretrained(out_dir, safe_serialization=True)


def load_hf(directory: str | Path, base: bool = False) -> nn.Module:
    """An exported directory back as a causal LM (or the base model), float32, eval mode."""
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModel if base else AutoModelForCausalLM
    return auto.from_pretrained(str(directory), trust_remote_code=True, dtype=torch.float32).eval()
