"""A Pre-LN LayerNorm arm as an RMSNorm model with the same logits (issue 36).

The algebra (Jiang et al. 2023, "Pre-RMSNorm and Pre-CRMSNorm Transformers", arXiv 2305.14858; the same
steps as TransformerLens' ``center_writing_weights`` + ``fold_ln``):

1. Centre every weight that writes into the residual stream: each row of the token and position embeddings,
   each output column of every attention and MLP output projection (``W - 1 mean_out(W)``) and their biases,
   made mean-zero across the d channels. The residual stream is then the original one minus its mean at every
   position: mean-zero, and a LayerNorm reads it exactly as before (it subtracts the mean anyway).
2. On a mean-zero x, ``LayerNorm(x) = g * x / sqrt(mean(x^2) + eps) + b = g * RMSNorm(x) + b`` (same eps).
3. Fold ``g`` and ``b`` forward into the linear layer each norm feeds: ``W (g * n + b) + c = (W diag g) n +
   (W b + c)``: ln1 into the attention's qkv, ln2 into the MLP's first layer, ln_f into the LM head. The final
   norm's gain makes a tied head untied (the head is ``W_U diag g``, the embedding is centred), and its bias
   becomes a bias of the LM head (``W_U b``). The RMSNorms keep gain 1.

Post-LN does not convert: there the residual stream *is* the norm's output, which is not mean-zero after its
bias, and the sublayers read the stream un-normalized. Dropout in training mode zeroes single channels of the
residual writes, so they would no longer be mean-zero.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from models.gpt import GPT, GPTConfig

CONVERTIBLE_ARMS = ("layer", "layer_nobias")
CONVERTED_NORM = "rms"
# Each residual norm, and the linear layer (in models.gpt's names) its output feeds.
FOLDS = {"ln1": "attn.c_attn", "ln2": "mlp.c_fc"}


def rms_conversion_refusal(gpt: GPT) -> str | None:
    """Why ``gpt`` cannot be converted to an RMSNorm model with the same logits, or None if it can."""
    cfg = gpt.config
    if cfg.norm in ("rms", "rms_bias"):
        return f"the {cfg.norm!r} arm is an RMSNorm model already: nothing to convert (export it without --as rms)"
    if cfg.norm not in CONVERTIBLE_ARMS:
        return (f"the {cfg.norm!r} arm has no mean subtraction to take out: only the Pre-LN LayerNorm arms "
                f"({', '.join(CONVERTIBLE_ARMS)}) convert to RMSNorm")
    if cfg.placement != "pre":
        return (f"the {cfg.placement}-LN {cfg.norm!r} arm does not convert: its residual stream is the norm's output "
                "(not mean-zero after the bias) and the sublayers read it un-normalized, so no RMSNorm model has its "
                "logits; only Pre-LN arms convert")
    if gpt.training and cfg.dropout > 0:
        return (f"the model is in training mode with dropout {cfg.dropout}: dropout zeroes single channels of the "
                "residual writes, which are then not mean-zero; call .eval() first")
    return None


def centred_rows(weight: torch.Tensor) -> torch.Tensor:
    """Each row made mean-zero across its last dimension (an embedding row: one vector written to the stream)."""
    return weight - weight.mean(dim=-1, keepdim=True)


def centred_outputs(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's (out, in) weight whose every output (column) is mean-zero across the ``out`` channels."""
    return weight - weight.mean(dim=0, keepdim=True)


def rms_config(config: GPTConfig) -> GPTConfig:
    """The converted model's config: RMSNorm, untied head, linear biases wherever a LayerNorm bias lands."""
    return replace(config, norm=CONVERTED_NORM, tie_embeddings=False, dropout=0.0,
                   bias=config.bias or lm_head_bias(config))


def lm_head_bias(config: GPTConfig) -> bool:
    """Whether the converted model's LM head has a bias: the final LayerNorm's bias folded into it."""
    return config.norm == "layer"


def rms_weights(gpt: GPT, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The converted model's tensors in ``models.gpt``'s names (plus ``lm_head.bias`` where the final norm had
    one), computed in float64 and returned in ``dtype``; see the module docstring for the algebra."""
    if refusal := rms_conversion_refusal(gpt):
        raise ValueError(refusal)
    cfg, target = gpt.config, rms_config(gpt.config)
    source = {name: tensor.detach().to(torch.float64) for name, tensor in gpt.state_dict().items()}
    ones = torch.ones(cfg.n_embd, dtype=torch.float64)

    def bias_of(name: str, size: int) -> torch.Tensor:
        # A bias the original lacks is zero; the converted model has one where a LayerNorm bias lands.
        return source.get(name, torch.zeros(size, dtype=torch.float64))

    def fold(norm: str, linear: str) -> tuple[torch.Tensor, torch.Tensor]:
        weight = source[f"{linear}.weight"]
        gain, shift = source[f"{norm}.weight"], bias_of(f"{norm}.bias", cfg.n_embd)
        return weight * gain, bias_of(f"{linear}.bias", weight.shape[0]) + weight @ shift

    out = {"wte.weight": centred_rows(source["wte.weight"]), "wpe.weight": centred_rows(source["wpe.weight"])}
    for i in range(cfg.n_layer):
        block = f"blocks.{i}."
        for norm, linear in FOLDS.items():
            weight, bias = fold(block + norm, block + linear)
            out[f"{block}{linear}.weight"] = weight
            if target.bias:
                out[f"{block}{linear}.bias"] = bias
            out[f"{block}{norm}.weight"] = ones
        for linear in ("attn.c_proj", "mlp.c_proj"):  # the sublayers' writes into the residual stream
            out[f"{block}{linear}.weight"] = centred_outputs(source[f"{block}{linear}.weight"])
            if target.bias:
                bias = bias_of(f"{block}{linear}.bias", cfg.n_embd)
                out[f"{block}{linear}.bias"] = bias - bias.mean()
    head, head_bias = fold("ln_f", "lm_head")  # lm_head.weight is the (uncentred) embedding when tied
    out["lm_head.weight"] = head
    if lm_head_bias(cfg):
        out["lm_head.bias"] = head_bias
    out["ln_f.weight"] = ones
    return {name: tensor.to(dtype) for name, tensor in out.items()}
