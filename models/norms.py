"""The one registry of norm arms: what each arm builds, how figures name and colour it, what it isolates.

An arm is its class, one :class:`NormArm` entry and its YAML in ``conf/train/norm/``. The model
(:func:`make_norm`), the config check, the probe, the figures, the verdict and the exports all read the arms
from :data:`NORM_ARMS`; a new arm needs nothing else. docs/probe.md tabulates the arms (the norm factorial).

Every arm runs in one of :data:`NORM_IMPLS` (``norm.impl``): ``stock``, the module as built, or
``compiled``, the same module with its forward compiled by ``torch.compile``, so that a cost comparison
compares the norms, not torch's kernel coverage (bench/norm_cost.py, docs/benchmarks.md).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._triton import has_triton  # cheap (0.4 ms): compile_refusal asks it for CUDA

# How an arm's module runs (norm.impl): "stock" as built, "compiled" with torch.compile'd forward.
NORM_IMPLS = ("stock", "compiled")

# How a norm treats its input, which decides what the probe can derive from it: "layer" centres and
# scales (its standardized input and output ellipsoid are defined), "rms" scales, "tanh" squashes
# element-wise (no standardized input, no ellipsoid).
SITE_KINDS = ("layer", "rms", "tanh")

# DyT's alpha at initialisation. For language models the DyT paper tunes alpha0 per model width and per
# place: larger for the DyT before attention than for the others (0.8 and 0.2 for LLaMA 7B); it finds
# that smaller widths tolerate larger alpha0. We use those two values at every size: 0.8 for the norm of
# the attention sublayer ("ln1") and 0.2 for the others (ln2, the final norm).
DYT_ALPHA_ATTENTION = 0.8
DYT_ALPHA_OTHER = 0.2


class RMSNormWithBias(nn.RMSNorm):
    """RMSNorm plus a learned bias (initialized to 0, like LayerNorm's): the factorial's "rms_bias" arm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


class DynamicTanh(nn.Module):
    """DyT: ``weight * tanh(alpha * x) + bias``; alpha a learned scalar, weight 1 and bias 0 at the start."""

    def __init__(self, dim: int, alpha_init: float) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.alpha * x) + self.bias

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, alpha_init={self.alpha.item():.3g}"


# arguments(dim, eps, role) -> the module_type's keyword arguments (JSON values: the Hugging Face export
# writes them into its config); role is "ln1" (before attention in pre-LN), "ln2" or "final".
NormArguments = Callable[[int, float, str], dict[str, Any]]
ROLES = ("ln1", "ln2", "final")
# The norms of the libraries an arm is exported to that can compute an arm exactly: GPT-2's
# (transformers' GPT2LMHeadModel: LayerNorm with a bias, zero where the arm has none) and TransformerLens'
# (HookedTransformer's normalization_type).
GPT2_NORMS = ("LayerNorm",)
TRANSFORMER_LENS_NORMS = ("LN", "RMS")


@dataclass(frozen=True)
class NormArm:
    name: str  # the config string: norm=<name>
    # The arm's module is module_type(**arguments(dim, eps, role)); module_type is also how the probe
    # recognises this arm's modules in a model, and the class whose source the Hugging Face export copies.
    module_type: type[nn.Module]
    arguments: NormArguments
    site_kind: str  # one of SITE_KINDS
    label: str  # in figures and tables
    color: str  # matplotlib colour, the same in every figure
    isolates: str  # the factor this arm varies, in a few words
    # The arms this one is contrasted with in the verdict, as (other arm, what the contrast isolates);
    # each difference is this arm minus the other.
    contrasts: tuple[tuple[str, str], ...] = ()
    gpt2: str | None = None  # the GPT2_NORMS module that computes this norm exactly, or None
    transformer_lens: str | None = None  # the TRANSFORMER_LENS_NORMS type that computes it exactly, or None
    # Where transformer_lens is None: what TransformerLens' norms lack for this arm, as its refusal says it
    # ("TransformerLens cannot hold the arm exactly: <this>").
    transformer_lens_lacks: str = ""

    def __post_init__(self) -> None:
        if self.site_kind not in SITE_KINDS:
            raise ValueError(f"arm {self.name!r}: site_kind {self.site_kind!r} is not one of {SITE_KINDS}")
        if self.gpt2 not in (None, *GPT2_NORMS):
            raise ValueError(f"arm {self.name!r}: gpt2 {self.gpt2!r} is not one of {GPT2_NORMS} or None")
        if self.transformer_lens not in (None, *TRANSFORMER_LENS_NORMS):
            raise ValueError(f"arm {self.name!r}: transformer_lens {self.transformer_lens!r} is not one of "
                             f"{TRANSFORMER_LENS_NORMS} or None")
        if (self.transformer_lens is None) == (not self.transformer_lens_lacks):
            raise ValueError(f"arm {self.name!r}: give transformer_lens_lacks exactly when no "
                             "transformer_lens norm holds it")

    def build(self, dim: int, eps: float, role: str) -> nn.Module:
        return self.module_type(**self.arguments(dim, eps, role))

    @property
    def centres(self) -> bool:
        """Whether the arm removes the component along 1 (the "layer" site kind: centre, then scale)."""
        return self.site_kind == "layer"

    @property
    def has_bias(self) -> bool:
        """Whether the arm's module has a learned bias, as its class builds it."""
        return "bias" in dict(self.build(2, 1e-5, "ln1").named_parameters())


NORM_ARMS: dict[str, NormArm] = {}


def register_arm(arm: NormArm) -> NormArm:
    """Add an arm (a research extension, or a test's toy arm); its YAML goes in conf/train/norm/."""
    if arm.name in NORM_ARMS:
        raise ValueError(f"a norm arm named {arm.name!r} is registered already")
    NORM_ARMS[arm.name] = arm
    return arm


def unregister_arm(name: str) -> None:
    NORM_ARMS.pop(name)


def make_norm(kind: str, dim: int, eps: float, role: str = "ln1", impl: str = "stock") -> nn.Module:
    """The one place where the arms differ, and where every arm gets its implementation (``NORM_IMPLS``);
    ``kind`` and ``impl`` as models.gpt.GPTConfig checked them."""
    module = NORM_ARMS[kind].build(dim, eps, role)
    if impl == "compiled":
        # The forward only, on the same module: its type (the probe's site kind), parameter names and
        # forward hooks stay the stock module's. The class's forward, bound to this instance, deep-copies
        # and pickles with it and is shared by the class's instances (guarded on shapes, not identity).
        # dynamic=False: one specialised kernel per input shape, as a hand-written kernel would be.
        module.forward = types.MethodType(torch.compile(type(module).forward, dynamic=False), module)
    return module


def compile_refusal(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot generate kernels for ``device_type`` ("cpu" or "cuda") here, or None:
    cheap checks (no compilation) of a supported Python, Triton for CUDA, a C++ compiler for CPU."""
    # The compiler's modules load only when compile=true is checked.
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python/platform (torch {torch.__version__})"
    if device_type == "cuda":
        return None if has_triton() else "torch.compile needs Triton for CUDA kernels and it is not installed"
    # inductor's C++ toolchain: loaded only for the CPU's compile check, like torch._dynamo above.
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        return ("torch.compile needs a C++ compiler for CPU kernels and none works here (install g++ or "
                "set CXX)")
    return None


def site_kind_of(module: nn.Module) -> str | None:
    """The site kind of a registered arm's module (most derived type first), None if no arm builds it."""
    for cls in type(module).__mro__:
        for arm in NORM_ARMS.values():
            if cls is arm.module_type:
                return arm.site_kind
    return None


def arm_label(name: str) -> str:
    return NORM_ARMS[name].label if name in NORM_ARMS else name


def arm_color(name: str) -> str | None:
    return NORM_ARMS[name].color if name in NORM_ARMS else None


def contrasts() -> list[tuple[str, str, str]]:
    """Every (arm, other arm, what it isolates) of the registry, in registration order."""
    return [(arm.name, other, what) for arm in NORM_ARMS.values() for other, what in arm.contrasts]


_DYT_CONTRAST = "normalization vs none (DyT)"

register_arm(NormArm(
    "layer", nn.LayerNorm, lambda dim, eps, role: {"normalized_shape": dim, "eps": eps, "bias": True},
    "layer", "LayerNorm", "tab:blue", "centring + scaling, with bias (the paper's LN arm)",
    contrasts=(("rms", "mean subtraction, as the paper compares it (LN's bias included)"),
               ("rms_bias", "mean subtraction, bias in both"),
               ("layer_nobias", "the bias alone (both centre)"),
               ("dyt", _DYT_CONTRAST)),
    gpt2="LayerNorm", transformer_lens="LN",
))
register_arm(NormArm(
    "rms", nn.RMSNorm, lambda dim, eps, role: {"normalized_shape": dim, "eps": eps},
    "rms", "RMSNorm", "tab:red", "scaling only, no bias (the paper's RMS arm)",
    contrasts=(("dyt", _DYT_CONTRAST),), transformer_lens="RMS",
))
register_arm(NormArm(
    "layer_nobias", nn.LayerNorm, lambda dim, eps, role: {"normalized_shape": dim, "eps": eps, "bias": False},
    "layer", "LayerNorm w/o bias", "tab:cyan", "centring + scaling, no bias",
    contrasts=(("rms", "mean subtraction, no bias in either"), ("dyt", _DYT_CONTRAST)),
    gpt2="LayerNorm", transformer_lens="LN",
))
register_arm(NormArm(
    "rms_bias", RMSNormWithBias, lambda dim, eps, role: {"dim": dim, "eps": eps},
    "rms", "RMSNorm + bias", "tab:orange", "scaling only, with bias",
    contrasts=(("dyt", _DYT_CONTRAST),), transformer_lens_lacks="its RMSNorm has no bias",
))
register_arm(NormArm(
    "dyt", DynamicTanh,
    lambda dim, eps, role: {"dim": dim,
                            "alpha_init": DYT_ALPHA_ATTENTION if role == "ln1" else DYT_ALPHA_OTHER},
    "tanh", "DyT (no norm)", "tab:green", "no normalization: tanh(alpha x) with gain and bias",
    transformer_lens_lacks="it has no tanh norm (DyT)",
))
