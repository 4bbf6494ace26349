"""Find every normalization module of a PyTorch model and label it (block index, role, LayerNorm or RMSNorm).

Works on our own GPT (``blocks.{i}.ln1``) and on Hugging Face models (GPT-2, GPT-Neo(X), GPT-J, Llama and
its descendants, BERT, T5, ...) from module names and classes alone: nothing is run through the model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from corpus.refusal import Refusal
from models.norms import site_kind_of
from normgeo.measure.geometry import STANDARDIZABLE_KINDS

_NORM_SUFFIXES = ("LayerNorm", "RMSNorm", "RmsNorm")
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
# Classes that transformers calls "LayerNorm" but that normalize T5-style: no mean subtraction, no bias.
_RMS_STYLE_LAYERNORMS = frozenset({
    "T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm", "LongT5LayerNorm", "SwitchTransformersLayerNorm",
    "Pix2StructLayerNorm", "Pop2PianoLayerNorm", "UdopLayerNorm", "Kosmos2_5LayerNorm", "CpmAntLayerNorm",
    "ImageGPTLayerNorm",
})
# eps hard-coded in forward() rather than stored on the module.
_CLASS_EPS = {"OlmoLayerNorm": 1e-5}

# Role of a norm from its path inside its block (the part after the block index).
_BLOCK_ROLES = {
    "ln_1": "ln1",  # GPT-2, GPT-Neo, GPT-J
    "ln1": "ln1",  # normgeo's GPT
    "input_layernorm": "ln1",  # GPT-NeoX, Llama family
    "ln_2": "ln2",
    "ln2": "ln2",
    "post_attention_layernorm": "ln2",  # pre-MLP in GPT-NeoX/Llama; see _POST_SUBLAYER_MARKER
    "pre_feedforward_layernorm": "ln2",  # Gemma 2/3
    "attention.output.LayerNorm": "attn_out",  # BERT family (post-LN)
    "output.LayerNorm": "mlp_out",
}
# In blocks that also have this norm (Gemma 2/3, OLMo 2), post_attention_layernorm normalizes the attention
# output before the residual add; it is not the pre-MLP norm, so it keeps its own name.
_POST_SUBLAYER_MARKER = "post_feedforward_layernorm"
_FINAL_NAMES = frozenset({"ln_f", "norm_f", "norm", "final_layer_norm", "final_layernorm", "final_norm",
                          "ln_final"})  # ln_final: TransformerLens


@dataclass(frozen=True)
class NormSite:
    name: str  # qualified module name, e.g. "model.layers.3.input_layernorm"
    layer: int | str  # 0-based block index, "final" (after the last block) or "embed" (on the embeddings)
    role: str  # "ln1", "ln2", "final", "embed", "attn_out", "mlp_out", else the module's attribute name
    kind: str  # "layer" (subtracts the mean), "rms" or "tanh" (DyT): models.norms.SITE_KINDS
    eps: float
    dim: int  # the normalized size d
    module: nn.Module = field(compare=False, hash=False, repr=False)
    # qualified name of the block that holds it (e.g. "model.layers.3"); None outside blocks
    block: str | None = None


class NoNormFoundError(Refusal, ValueError):
    """The model has no module that :func:`find_norm_sites` recognizes as a normalization."""


def _is_norm_module(module: nn.Module) -> bool:
    """torch's LayerNorm/RMSNorm, or a class named
    ``*LayerNorm``/``*RMSNorm``/``*RmsNorm`` made only of norms.

    The second condition keeps out whole layers that transformers names after their norm placement
    (``Wav2Vec2EncoderLayerStableLayerNorm`` holds attention and MLP); hook points (TransformerLens'
    ``HookPoint``, an identity module in each of its norms) are no layer.
    """
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or site_kind_of(module) is not None:
        return True
    return type(module).__name__.endswith(_NORM_SUFFIXES) and all(
        _is_norm_module(c) or type(c).__name__ == "HookPoint" for c in module.children()
    )


def _norm_kind(module: nn.Module) -> str:
    registered = site_kind_of(module)  # our arms (models.norms), DyT included
    if registered is not None:
        return registered
    if isinstance(module, nn.RMSNorm):
        return "rms"
    for cls in type(module).__mro__:
        if "RMS" in cls.__name__ or "Rms" in cls.__name__ or cls.__name__ in _RMS_STYLE_LAYERNORMS:
            return "rms"
    return "layer"


def _unreadable(name: str, module: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"cannot read the {what} of norm module {name!r} ({type(module).__name__}); build its NormSite by "
        "hand and pass the list as `norms=` to normgeo.measure.pipeline.measure_records"
    )


def _norm_eps(name: str, module: nn.Module) -> float:
    # A wrapper norm (e.g. gain on top of an affine-free nn.LayerNorm) keeps eps on the module it wraps.
    for sub in module.modules():
        for attr in _EPS_ATTRS:
            if hasattr(sub, attr):
                eps = getattr(sub, attr)
                if eps is None:
                    # nn.RMSNorm(eps=None) uses the machine epsilon of the input's dtype.
                    param = next(sub.parameters(), None)
                    return torch.finfo(param.dtype if param is not None else torch.get_default_dtype()).eps
                return float(eps)
        if type(sub).__name__ in _CLASS_EPS:
            return _CLASS_EPS[type(sub).__name__]
    raise _unreadable(name, module, "eps")


def _norm_dim(name: str, module: nn.Module) -> int:
    for sub in module.modules():
        shape = getattr(sub, "normalized_shape", None)
        if shape is not None:
            return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
        weight = getattr(sub, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight.numel()
        if isinstance(getattr(sub, "hidden_size", None), int):
            return sub.hidden_size
        if isinstance(getattr(sub, "w", None), torch.Tensor):  # TransformerLens' LayerNorm and RMSNorm
            return sub.w.numel()
    raise _unreadable(name, module, "normalized size")


def _block_position(name: str, modules: dict[str, nn.Module]) -> tuple[int, str, str, str] | None:
    """(block index, block prefix, path inside the block, path of the stack's owner) of a norm in a block.

    The block stack is the outermost ModuleList on the path: T5's ``encoder.block.0.layer.1.layer_norm`` is
    in block 0 of the stack owned by ``encoder``.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and isinstance(modules[".".join(parts[:i])], nn.ModuleList):
            inner, owner = ".".join(parts[i + 1 :]), ".".join(parts[: max(i - 1, 0)])
            return int(part), ".".join(parts[: i + 1]), inner, owner
    return None


def find_norm_sites(model: nn.Module) -> list[NormSite]:
    """Every normalization module of ``model`` in registration order, labelled by block, role and kind.

    A norm inside another norm is not listed. (layer, role) is unique: where the naming rules would give
    two norms the same label (T5), they fall back to their path inside the block, then to that path under
    the stack's owner ("decoder.layer.0.layer_norm"), then to their qualified name.
    """
    modules = dict(model.named_modules())
    found: list[tuple[str, nn.Module]] = []
    for name, module in modules.items():
        if any(not outer or name.startswith(f"{outer}.") for outer, _ in found):
            continue  # inside a norm already listed (outer "" is the model itself)
        if _is_norm_module(module):
            found.append((name, module))
    if not found:
        classes = sorted({type(m).__name__ for m in modules.values()})
        raise NoNormFoundError(
            f"no normalization module found in {type(model).__name__} (its module classes: {classes}). "
            "find_norm_sites recognizes torch.nn.LayerNorm, torch.nn.RMSNorm and classes whose name ends "
            "with LayerNorm/RMSNorm/RmsNorm; if this model normalizes with another class, build the NormSite "
            "list by hand and pass it as `norms=` to normgeo.measure.pipeline.measure_records"
        )

    positions = [_block_position(name, modules) for name, _ in found]
    first_block = next((i for i, pos in enumerate(positions) if pos is not None), None)
    block_members: dict[str, set[str]] = defaultdict(set)
    for pos in positions:
        if pos is not None:
            block_members[pos[1]].add(pos[2])

    layers: list[int | str] = []
    blocks: list[str | None] = [pos[1] if pos is not None else None for pos in positions]
    candidates: list[list[str]] = []  # role, then fallbacks that tell colliding norms apart
    for i, ((name, _), pos) in enumerate(zip(found, positions, strict=True)):
        attr = name.rsplit(".", 1)[-1]
        if pos is not None:
            index, prefix, inner, owner = pos
            role = _BLOCK_ROLES.get(inner, attr)
            if inner == "post_attention_layernorm" and _POST_SUBLAYER_MARKER in block_members[prefix]:
                role = attr
            layers.append(index)
            candidates.append([role, inner, f"{owner}.{inner}" if owner else inner, name])
        else:
            if "emb" in name.lower():
                role = "embed"
            elif attr in _FINAL_NAMES or "final" in name.lower():
                role = "final"
            else:  # position: norms before the first block act on the embeddings
                role = "embed" if first_block is not None and i < first_block else "final"
            layers.append(role)
            candidates.append([role, name])

    level = [0] * len(found)
    while True:
        groups: dict[tuple[int | str, str], list[int]] = defaultdict(list)
        for i, layer in enumerate(layers):
            groups[(layer, candidates[i][level[i]])].append(i)
        clashes = [i for members in groups.values() if len(members) > 1 for i in members]
        if not clashes:
            break
        for i in clashes:
            level[i] = min(level[i] + 1, len(candidates[i]) - 1)

    return [
        NormSite(name=name, layer=layers[i], role=candidates[i][level[i]], kind=_norm_kind(module),
                 eps=_norm_eps(name, module) if _norm_kind(module) in STANDARDIZABLE_KINDS else 0.0,
                 dim=_norm_dim(name, module), module=module, block=blocks[i])
        for i, (name, module) in enumerate(found)
    ]
