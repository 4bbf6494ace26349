"""normgeo's GPT -> a Hugging Face ``transformers`` model, with the same logits.

A Pre-LN arm whose registration (:mod:`models.norms`) names GPT-2's ``LayerNorm`` -> ``GPT2LMHeadModel``;
every other arm and every Post-LN arm -> :mod:`models.export.modeling_normgeo`, saved with the source it
needs (:func:`model_code`) and loaded with ``trust_remote_code=True``. ``to_hf(gpt, as_rms=True)`` converts
a Pre-LN LayerNorm arm to an RMSNorm model with the same logits (Jiang et al. 2023, arXiv 2305.14858):
centre every weight that writes into the residual stream, then fold each norm's gain and bias into the
linear layer it feeds. docs/export.md gives the algebra and why each class holds its arms.
"""

from __future__ import annotations

import copy
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from models.export import modeling_normgeo
from models.export.modeling_normgeo import NORM_CLASSES, NormGeoConfig, NormGeoForCausalLM, NormGeoModel
from models.gpt import GPT, MLP, CausalSelfAttention, GPTConfig
from models.norms import NORM_ARMS, ROLES

CONVERTED_NORM = "rms"
MODEL_CODE_FILE = Path(modeling_normgeo.__file__).name
# Each residual norm, and the linear layer (in models.gpt's names) its output feeds.
FOLDS = {"ln1": "attn.c_attn", "ln2": "mlp.c_fc"}
# The models.gpt classes modeling_normgeo imports: the saved copy holds their source instead.
GPT_CLASSES = (CausalSelfAttention, MLP)


def convertible_arms() -> tuple[str, ...]:
    """The arms whose norm is a LayerNorm (GPT-2's): the conversion's algebra is LayerNorm's."""
    return tuple(name for name, arm in NORM_ARMS.items() if arm.gpt2 == "LayerNorm")


def rms_conversion_refusal(gpt: GPT) -> str | None:
    """Why ``gpt`` cannot be converted to an RMSNorm model with the same logits, or None if it can."""
    cfg = gpt.config
    arm = NORM_ARMS[cfg.norm]
    if not arm.centres and arm.site_kind == "rms":
        return (f"the {cfg.norm!r} arm is an RMSNorm model already: nothing to convert "
                "(export it without --as rms)")
    if cfg.norm not in convertible_arms():
        what = "centres, but not as a LayerNorm" if arm.centres else "has no mean subtraction to take out"
        return (f"the {cfg.norm!r} arm {what}: only the Pre-LN LayerNorm arms "
                f"({', '.join(convertible_arms())}) convert to RMSNorm")
    if cfg.placement != "pre":
        return (f"the {cfg.placement}-LN {cfg.norm!r} arm does not convert: its residual stream is the "
                "norm's output (not mean-zero after the bias) and the sublayers read it un-normalized, so no "
                "RMSNorm model has its logits; only Pre-LN arms convert")
    if gpt.training and cfg.dropout > 0:
        return (f"the model is in training mode with dropout {cfg.dropout}: dropout zeroes single channels "
                "of the residual writes, which are then not mean-zero; call .eval() first")
    return None


def centred_rows(weight: torch.Tensor) -> torch.Tensor:
    """Each row (an embedding row: one vector written to the stream) made mean-zero."""
    return weight - weight.mean(dim=-1, keepdim=True)


def centred_outputs(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's (out, in) weight with every column mean-zero across the ``out`` channels."""
    return weight - weight.mean(dim=0, keepdim=True)


def rms_config(config: GPTConfig) -> GPTConfig:
    """The converted model's config: RMSNorm, untied head, linear biases wherever a LayerNorm bias lands."""
    return replace(config, norm=CONVERTED_NORM, tie_embeddings=False, dropout=0.0,
                   bias=config.bias or lm_head_bias(config))


def lm_head_bias(config: GPTConfig) -> bool:
    """Whether the converted model's LM head has a bias: the final LayerNorm's bias folded into it."""
    return NORM_ARMS[config.norm].has_bias


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


def holds_as_gpt2(gpt: GPT) -> bool:
    """True if ``GPT2LMHeadModel`` holds this model exactly (pre-LN, an arm GPT-2's LayerNorm computes)."""
    return gpt.config.placement == "pre" and NORM_ARMS[gpt.config.norm].gpt2 is not None


def hf_class_name(gpt: GPT, as_rms: bool = False) -> str:
    return "GPT2LMHeadModel" if holds_as_gpt2(gpt) and not as_rms else "NormGeoForCausalLM"


def _weights(gpt: GPT, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The model's tensors in ``dtype``, each once (a tied head is the embedding)."""
    state = {name: tensor.detach().to(dtype).clone() for name, tensor in gpt.state_dict().items()}
    if gpt.config.tie_embeddings:
        state.pop("lm_head.weight")
    return state


def _gpt2_state_dict(gpt: GPT, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    cfg = gpt.config
    source = _weights(gpt, dtype)
    zeros = lambda n: torch.zeros(n, dtype=dtype)  # noqa: E731 - a bias GPT-2 always has and an arm may lack
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


def common_config(cfg: GPTConfig) -> dict:
    """The keyword arguments GPT2Config and NormGeoConfig share (the padded vocabulary, EOS as BOS)."""
    return dict(vocab_size=cfg.padded_vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                n_layer=cfg.n_layer, n_head=cfg.n_head, tie_word_embeddings=cfg.tie_embeddings,
                bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1)


def _gpt2(gpt: GPT, dtype: torch.dtype) -> nn.Module:
    cfg = gpt.config
    config = GPT2Config(**common_config(cfg), n_inner=4 * cfg.n_embd, activation_function="gelu_pytorch_tanh",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_eps)
    model = GPT2LMHeadModel(config).to(dtype)
    model.load_state_dict(_gpt2_state_dict(gpt, dtype), strict=not cfg.tie_embeddings)
    return model


def _normgeo(cfg: GPTConfig, weights: dict[str, torch.Tensor], lm_head_bias: bool = False) -> nn.Module:
    """The saved model code holding ``cfg``'s arm, loaded with ``weights`` (``models.gpt``'s names)."""
    NormGeoConfig.register_for_auto_class()
    NormGeoForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    arm = NORM_ARMS[cfg.norm]
    # In this process the model code builds the arm's own class; the saved copy defines it (model_code).
    NORM_CLASSES[arm.module_type.__name__] = arm.module_type
    config = NormGeoConfig(
        **common_config(cfg), norm=cfg.norm, norm_class=arm.module_type.__name__,
        norm_arguments={role: arm.arguments(cfg.n_embd, cfg.norm_eps, role) for role in ROLES},
        placement=cfg.placement, bias=cfg.bias, lm_head_bias=lm_head_bias,
    )
    model = NormGeoForCausalLM(config).to(next(iter(weights.values())).dtype)
    # save_pretrained records the saved class only; AutoModel (the base model analyze.py measures) is added.
    model.config.auto_map = {"AutoConfig": "modeling_normgeo.NormGeoConfig",
                             "AutoModel": f"modeling_normgeo.{NormGeoModel.__name__}",
                             "AutoModelForCausalLM": "modeling_normgeo.NormGeoForCausalLM"}
    state = {(k if k.startswith("lm_head.") else f"transformer.{k}"): v for k, v in weights.items()}
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    return model


def to_hf(gpt: GPT, *, as_rms: bool = False, dtype: torch.dtype = torch.float32,
          model_code: bool = False) -> nn.Module:
    """The ``transformers`` causal LM (``dtype``, eval mode) whose logits are ``gpt``'s. ``as_rms``: a Pre-LN
    LayerNorm arm converted to an RMSNorm model in the saved model code (ValueError for an arm that does not
    convert). ``model_code``: the saved model code even where ``GPT2LMHeadModel`` holds the arm (to time it
    beside its conversion with the same code)."""
    if as_rms:
        cfg = rms_config(gpt.config)
        model = _normgeo(cfg, rms_weights(gpt, dtype), lm_head_bias=lm_head_bias(gpt.config))
    else:
        cfg = gpt.config
        gpt2 = holds_as_gpt2(gpt) and not model_code
        model = _gpt2(gpt, dtype) if gpt2 else _normgeo(cfg, _weights(gpt, dtype))
    if cfg.tie_embeddings:
        model.tie_weights()
    if cfg.tie_embeddings != (model.lm_head.weight is model.get_input_embeddings().weight):
        raise RuntimeError("the exported head's tying differs from the harness model's")
    return model.to(dtype).eval()


def own_classes(cls: type) -> list[type]:
    """``cls`` and its bases that are not torch's (nor Python's), base first: what the saved code defines."""
    return [c for c in reversed(cls.__mro__) if c.__module__.partition(".")[0] not in ("torch", "builtins")]


def global_names(code: types.CodeType) -> set[str]:
    """The names a function's code (and the code nested in it) reads, globals among them."""
    nested = [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return set(code.co_names).union(*map(global_names, nested))


def class_source(cls: type) -> str:
    """``cls``'s source with the imports and constants of its module that its methods read."""
    namespace = vars(sys.modules[cls.__module__])
    read = set().union(*(global_names(f.__code__) for f in vars(cls).values() if inspect.isfunction(f)))
    lines = []
    for name in sorted(read & namespace.keys()):
        value = namespace[name]
        if isinstance(value, types.ModuleType):
            lines.append(f"import {value.__name__}" + ("" if value.__name__ == name else f" as {name}"))
        elif isinstance(value, (bool, int, float, str)):
            lines.append(f"{name} = {value!r}")
        elif not isinstance(value, type) or value not in own_classes(cls):
            raise TypeError(f"{cls.__qualname__} reads {name} of its module, which the saved model code "
                            "cannot copy: import it in a method, or make it a constant")
    return "\n".join([*lines, "", textwrap.dedent(inspect.getsource(cls))])


def model_code(norm: str) -> str:
    """The saved model code of arm ``norm``: :mod:`models.export.modeling_normgeo` with the source of the
    ``models.gpt`` classes it imports in place of that import and, appended, the arm's class (its source and
    its own bases', or torch's import) added to ``NORM_CLASSES``."""
    cls = NORM_ARMS[norm].module_type
    own = own_classes(cls)
    code = Path(modeling_normgeo.__file__).read_text()
    gpt_import = next(line for line in code.splitlines() if line.startswith("from models.gpt import "))
    gpt_classes = "\n\n".join(map(class_source, GPT_CLASSES))
    parts = [code.replace(gpt_import, f"# models/gpt.py's, written from its source.\n{gpt_classes}"),
             f"# The norm of arm {norm!r}, written from its registration (normgeo's models.norms.NORM_ARMS).",
             *map(class_source, own)]
    if not own:
        parts.append(f"from {cls.__module__} import {cls.__name__}")
    parts.append(f"NORM_CLASSES[{cls.__name__!r}] = {cls.__name__}\n")
    return "\n\n".join(parts)


def save_hf(gpt: GPT, out_dir: Path, as_rms: bool = False) -> None:
    """``model.safetensors`` and ``config.json`` (plus the model code, :func:`model_code`, where no built-in
    class holds the arm); ``as_rms``: the arm converted to RMSNorm (the module docstring's algebra)."""
    model = to_hf(gpt, as_rms=as_rms)
    model.save_pretrained(out_dir, safe_serialization=True)
    if isinstance(model, NormGeoForCausalLM):  # transformers copied the file as it is; the arm's class added
        (out_dir / MODEL_CODE_FILE).write_text(model_code(model.config.norm))


@dataclass(frozen=True)
class RmsParity:
    """How far the RMSNorm conversion's logits are from the original's on some token ids."""

    float64_relative: float  # max |converted - original| / max |original|, both models in float64
    float32_max_abs: float  # max |converted - original|, both in float32 (the saved weights)
    # max |original in float32 - original in float64|: float32's own rounding, the scale float32_max_abs is on
    float32_rounding: float


@torch.no_grad()
def rms_parity(gpt: GPT, ids: torch.Tensor) -> RmsParity:
    """The conversion's logit parity on ``ids`` (batch, seq), in float64 and float32; ``gpt`` is unchanged."""
    reference64 = copy.deepcopy(gpt).double().eval()(ids)
    diff64 = (to_hf(gpt, as_rms=True, dtype=torch.float64)(ids).logits - reference64).abs().max()
    reference32 = copy.deepcopy(gpt).float().eval()(ids)
    diff32 = (to_hf(gpt, as_rms=True)(ids).logits - reference32).abs().max()
    return RmsParity(float((diff64 / reference64.abs().max()).item()), float(diff32.item()),
                     float((reference32.double() - reference64).abs().max().item()))


def load_hf(directory: str | Path, base: bool = False) -> nn.Module:
    """An exported directory back as a causal LM (or the base model), float32, eval mode."""
    auto = AutoModel if base else AutoModelForCausalLM
    return auto.from_pretrained(str(directory), trust_remote_code=True, dtype=torch.float32).eval()
