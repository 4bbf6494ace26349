"""A GPT-2 language model whose arms differ only in the normalization layer.

Pre-norm blocks as in the paper's eq. 12-16 (norm -> attention, residual; norm -> GELU MLP, residual),
learned absolute positions, a final norm before the LM head; or, with ``placement="post"``, post-norm
blocks (attention, residual, norm; MLP, residual, norm) with the same parameters. The norm is chosen by
one string, an arm of the registry in :mod:`models.norms`; every other parameter is initialized from a
generator seeded by (seed, parameter name), so all norm arms and both placements start from
bitwise-identical non-norm weights.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from corpus.refusal import Refusal
from models.norms import NORM_ARMS, NORM_IMPLS, make_norm

# pre: the norm before each sublayer, a final norm before the head (GPT-2). post: the norm after each
# residual add (the original Transformer); ln_f is kept so both placements have the same parameters.
PLACEMENTS = ("pre", "post")
GPT2_VOCAB_SIZE = 50257


class ArchitectureError(Refusal, ValueError):
    """A GPTConfig field the model cannot be built with: the field, its value and what it expects."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        super().__init__(f"{field}={value!r}: expected {expected}")
        self.field, self.value, self.expected = field, value, expected


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 128
    block_size: int = 1024
    vocab_size: int = GPT2_VOCAB_SIZE
    # Pad the embedding table to a multiple of this for fast matmuls; padded rows are never targets.
    vocab_multiple: int = 64
    norm: str = "layer"
    norm_eps: float = 1e-5
    # stock | compiled: how every norm module runs (models.norms.make_norm); the weights are the same.
    norm_impl: str = "stock"
    placement: str = "pre"
    tie_embeddings: bool = True
    dropout: float = 0.0
    bias: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        """The one check of the architecture's choices (train.py's config check asks it, naming its keys)."""
        for name, ok, expected in (
            ("norm", self.norm in NORM_ARMS, f"one of {', '.join(NORM_ARMS)}"),
            ("norm_impl", self.norm_impl in NORM_IMPLS, " or ".join(NORM_IMPLS)),
            ("placement", self.placement in PLACEMENTS, f"one of {', '.join(PLACEMENTS)}"),
            ("n_head", self.n_head > 0 and self.n_embd % self.n_head == 0,
             f"a divisor of n_embd={self.n_embd}"),
        ):
            if not ok:
                raise ArchitectureError(name, getattr(self, name), expected)

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    def to_dict(self) -> dict:
        return asdict(self)


def is_norm_parameter(name: str) -> bool:
    """Parameters owned by a norm module (the only ones allowed to differ between arms)."""
    owner = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
    return owner in ("ln1", "ln2", "ln_f")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Flash / memory-efficient kernels on GPU, the math kernel on CPU: same result either way.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = make_norm(config.norm, config.n_embd, config.norm_eps, "ln1", config.norm_impl)
        self.attn = CausalSelfAttention(config)
        self.ln2 = make_norm(config.norm, config.n_embd, config.norm_eps, "ln2", config.norm_impl)
        self.mlp = MLP(config)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.post_norm = config.placement == "post"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_norm:  # Vaswani et al.: normalize the residual stream after each add
            x = self.ln1(x + self.resid_dropout(self.attn(x)))
            return self.ln2(x + self.mlp(x))
        x = x + self.resid_dropout(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = make_norm(config.norm, config.n_embd, config.norm_eps, "final", config.norm_impl)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init, each tensor drawn from its own generator seeded by (seed, name).

        Seeding per name (not one stream in creation order) is what makes the arms' non-norm
        weights identical although the LN arm has extra bias tensors the RMS arm lacks.
        """
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if is_norm_parameter(name):
                # Each arm initializes its own norm parameters (gain 1, bias 0; DyT's alpha).
                continue
            if name.endswith(".bias"):
                param.zero_()
                continue
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            std = residual_std if name.endswith("c_proj.weight") else self.config.init_std
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.copy_(values.to(param.dtype))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final norm's output for ``idx`` (batch, seq): what the LM head reads (a probe that needs no
        logits stops here). Call it on a model that is not sharded: FSDP2 gathers the root's weights in
        ``forward``."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence of {seq} tokens exceeds block_size={self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def num_parameters(self, exclude_positions: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())  # a tied matrix counts once
        return total - self.wpe.weight.numel() if exclude_positions else total

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``idx`` (batch, seq); with ``targets``, the mean cross-entropy instead."""
        logits = self.lm_head(self.hidden(idx))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6N plus attention (PaLM appendix B)."""
        cfg = self.config
        return 6 * self.num_parameters(exclude_positions=True) + 12 * cfg.n_layer * cfg.n_embd * seq_len
