"""normgeo's GPT in the interpretability tools: TransformerLens and nnsight.

TransformerLens 3.9's ``HookedTransformer`` holds the Pre-LN arms whose registration (:mod:`models.norms`)
names its norm (``LN``, ``RMS``); for the others the export refuses (:func:`transformer_lens_refusal`). The
weights are loaded with its processing OFF: its defaults keep the log-probs but rewrite the geometry this
project measures (docs/export.md, "The TransformerLens trap"). :func:`to_nnsight` wraps any module, such as
the exported Hugging Face model (every arm and placement).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from einops import rearrange
from safetensors.torch import load_file, save_file
from torch import nn

from models.gpt import GPT, GPTConfig
from models.norms import NORM_ARMS

TRANSFORMER_LENS_TARGET = "transformer-lens 3.9 (HookedTransformer)"
TL_CONFIG_FILE = "tl_config.json"
TL_WEIGHTS_FILE = "model.safetensors"
# Every processing step off: see the module docstring (the angle with 1 must stay as trained).
NO_PROCESSING = {"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                 "fold_value_biases": False, "refactor_factored_attn_matrices": False}


def transformer_lens_refusal(config: GPTConfig) -> str | None:
    """Why TransformerLens cannot hold this arm exactly, or None if it can."""
    if config.placement != "pre":
        return ("TransformerLens' HookedTransformer has pre-norm blocks only: it cannot hold the "
                f"{config.placement}-LN arm {config.norm!r} (export it with --to hf or --to nnsight)")
    arm = NORM_ARMS[config.norm]
    if arm.transformer_lens is None:
        return (f"TransformerLens cannot hold the {config.norm!r} arm exactly: {arm.transformer_lens_lacks} "
                "(export it with --to hf or --to nnsight)")
    return None


def held_by_transformer_lens(config: GPTConfig) -> None:
    """ValueError with :func:`transformer_lens_refusal`'s reason for an arm TransformerLens cannot hold."""
    if refusal := transformer_lens_refusal(config):
        raise ValueError(refusal)


def transformer_lens_config(config: GPTConfig) -> dict:
    """``HookedTransformerConfig`` keyword arguments for this arm (JSON-serializable)."""
    return {
        "n_layers": config.n_layer, "d_model": config.n_embd, "n_ctx": config.block_size,
        "n_heads": config.n_head, "d_head": config.n_embd // config.n_head, "d_mlp": 4 * config.n_embd,
        "d_vocab": config.padded_vocab_size, "d_vocab_out": config.padded_vocab_size,
        "act_fn": "gelu_pytorch_tanh", "normalization_type": NORM_ARMS[config.norm].transformer_lens,
        "eps": config.norm_eps,
        "positional_embedding_type": "standard", "default_prepend_bos": False,
        "model_name": f"normgeo-{config.norm}",
    }


def transformer_lens_state_dict(gpt: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under HookedTransformer's names and shapes (per-head attention matrices)."""
    cfg = gpt.config
    source = {name: tensor.detach().float() for name, tensor in gpt.state_dict().items()}
    heads, width = cfg.n_head, cfg.n_embd
    zeros = lambda *shape: torch.zeros(*shape)  # noqa: E731 - a bias TransformerLens always has
    state = {"embed.W_E": source["wte.weight"], "pos_embed.W_pos": source["wpe.weight"]}

    def norm(ours: str, theirs: str) -> None:
        state[f"{theirs}.w"] = source[f"{ours}.weight"]
        if NORM_ARMS[cfg.norm].transformer_lens == "LN":
            state[f"{theirs}.b"] = source.get(f"{ours}.bias", zeros(width))

    for i in range(cfg.n_layer):
        ours = theirs = f"blocks.{i}."  # the same prefix in both
        norm(f"{ours}ln1", f"{theirs}ln1")
        norm(f"{ours}ln2", f"{theirs}ln2")
        qkv_w = source[f"{ours}attn.c_attn.weight"]
        qkv_b = source.get(f"{ours}attn.c_attn.bias", zeros(3 * width))
        for name, w, b in zip("QKV", qkv_w.split(width, 0), qkv_b.split(width, 0), strict=True):
            state[f"{theirs}attn.W_{name}"] = rearrange(w, "(h dh) m -> h m dh", h=heads).contiguous()
            state[f"{theirs}attn.b_{name}"] = rearrange(b, "(h dh) -> h dh", h=heads).contiguous()
        out_w = source[f"{ours}attn.c_proj.weight"]
        state[f"{theirs}attn.W_O"] = rearrange(out_w, "m (h dh) -> h dh m", h=heads).contiguous()
        state[f"{theirs}attn.b_O"] = source.get(f"{ours}attn.c_proj.bias", zeros(width))
        state[f"{theirs}mlp.W_in"] = source[f"{ours}mlp.c_fc.weight"].t().contiguous()
        state[f"{theirs}mlp.b_in"] = source.get(f"{ours}mlp.c_fc.bias", zeros(4 * width))
        state[f"{theirs}mlp.W_out"] = source[f"{ours}mlp.c_proj.weight"].t().contiguous()
        state[f"{theirs}mlp.b_out"] = source.get(f"{ours}mlp.c_proj.bias", zeros(width))
    norm("ln_f", "ln_final")
    state["unembed.W_U"] = source["lm_head.weight"].t().contiguous()
    state["unembed.b_U"] = zeros(cfg.padded_vocab_size)
    return state


def hooked_transformer(config: dict, state: dict[str, torch.Tensor], process: bool = False, tokenizer=None):
    """A ``HookedTransformer`` from its config and weights; ``process=True`` applies TransformerLens' defaults
    (only to show what they do to the geometry: never for measuring it)."""
    # TransformerLens takes seconds to import: only for --to transformer-lens.
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    with warnings.catch_warnings():  # 3.9 announces HookedTransformer's removal in 4.0: the version targeted
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(HookedTransformerConfig(**config), tokenizer=tokenizer,
                                  move_to_device=False)
    model.load_and_process_state_dict(dict(state), **({} if process else NO_PROCESSING))
    return model.eval()


def to_transformer_lens(gpt: GPT, process: bool = False, tokenizer=None):
    """The arm as a TransformerLens ``HookedTransformer`` (processing off); ValueError for an arm it cannot
    hold."""
    held_by_transformer_lens(gpt.config)
    return hooked_transformer(transformer_lens_config(gpt.config), transformer_lens_state_dict(gpt), process,
                              tokenizer)


def save_transformer_lens(gpt: GPT, out_dir: Path) -> None:
    """``tl_config.json`` (HookedTransformerConfig's arguments) and ``model.safetensors`` (its state dict)."""
    held_by_transformer_lens(gpt.config)
    (out_dir / TL_CONFIG_FILE).write_text(json.dumps(transformer_lens_config(gpt.config), indent=2) + "\n")
    save_file(transformer_lens_state_dict(gpt), str(out_dir / TL_WEIGHTS_FILE))


def load_transformer_lens(directory: str | Path, tokenizer=None):
    """A ``--to transformer-lens`` export back as a HookedTransformer, processing off."""
    directory = Path(directory)
    config = json.loads((directory / TL_CONFIG_FILE).read_text())
    return hooked_transformer(config, load_file(str(directory / TL_WEIGHTS_FILE)), tokenizer=tokenizer)


def to_nnsight(model: nn.Module):
    """``nnsight.NNsight`` around a model (an exported Hugging Face model, or the harness's GPT itself)."""
    # nnsight is imported only for --to nnsight.
    from nnsight import NNsight

    return NNsight(model)
