"""normgeo's GPT as a Hugging Face model, for the arms no built-in transformers class holds exactly.

Self-contained once saved (torch and transformers only): :mod:`models.export.hf` saves this file beside the
exported weights with the source of ``models/gpt.py``'s attention and MLP in place of their import and the
arm's norm class appended, and ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` runs it
without normgeo installed. The blocks are ``models/gpt.py``'s operation for operation, so the logits are the
harness model's; every norm is ``NORM_CLASSES[norm_class](**norm_arguments[role])``, as the arm's
registration builds it. ``lm_head_bias``: the LM head bias of a LayerNorm arm converted to RMSNorm
(``--as rms``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from models.gpt import MLP, CausalSelfAttention  # the saved copy: their source (models.export.hf.model_code)


class NormGeoConfig(PretrainedConfig):
    model_type = "normgeo"
    dropout = 0.0  # read by models.gpt's attention and MLP; a class attribute, so not in config.json

    def __init__(self, vocab_size: int = 50304, n_positions: int = 1024, n_embd: int = 128, n_layer: int = 2,
                 n_head: int = 2, norm: str = "layer", norm_class: str = "LayerNorm",
                 norm_arguments: dict[str, dict] | None = None, placement: str = "pre", bias: bool = True,
                 lm_head_bias: bool = False, tie_word_embeddings: bool = True, **kwargs) -> None:
        self.vocab_size = vocab_size
        # Each size under transformers' generic name too.
        self.n_positions = self.max_position_embeddings = n_positions
        self.n_embd = self.hidden_size = n_embd
        self.n_layer = self.num_hidden_layers = n_layer
        self.n_head = self.num_attention_heads = n_head
        self.norm = norm  # the arm's name, for the reader
        self.norm_class = norm_class
        self.norm_arguments = norm_arguments or {}  # the class's keyword arguments, per role
        self.placement = placement
        self.bias = bias
        self.lm_head_bias = lm_head_bias
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# The norm classes by name: the saved copy of this file ends with the arm's class, added here
# (models.export.hf.model_code); in normgeo's own process models.export.hf adds it.
NORM_CLASSES: dict[str, type[nn.Module]] = {}


def make_norm(config: NormGeoConfig, role: str) -> nn.Module:
    """The norm of ``role`` ("ln1", "ln2" or "final"), as the arm's registration builds it."""
    if config.norm_class not in NORM_CLASSES:
        raise ValueError(f"unknown norm class {config.norm_class!r}: one of {', '.join(NORM_CLASSES)}")
    return NORM_CLASSES[config.norm_class](**config.norm_arguments[role])


class Block(nn.Module):
    def __init__(self, config: NormGeoConfig) -> None:
        super().__init__()
        self.ln1 = make_norm(config, "ln1")
        self.attn = CausalSelfAttention(config)
        self.ln2 = make_norm(config, "ln2")
        self.mlp = MLP(config)
        self.post_norm = config.placement == "post"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_norm:
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.mlp(x))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NormGeoPreTrainedModel(PreTrainedModel):
    config_class = NormGeoConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["Block"]

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing to initialize: exported weights overwrite every parameter."""


def _check_mask(attention_mask: torch.Tensor | None) -> None:
    # Causal attention without a padding mask, as in training: right padding is harmless, left padding is not.
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("NormGeoModel attends causally without a padding mask: pad on the right, not the "
                         "left")


class NormGeoModel(NormGeoPreTrainedModel):
    """The base model (no LM head): the final norm's output as ``last_hidden_state``."""

    def __init__(self, config: NormGeoConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = make_norm(config, "final")
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutput:
        _check_mask(attention_mask)
        seq = input_ids.shape[1]
        if seq > self.config.n_positions:
            raise ValueError(f"sequence of {seq} tokens exceeds n_positions={self.config.n_positions}")
        x = self.wte(input_ids) + self.wpe(torch.arange(seq, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return BaseModelOutput(last_hidden_state=self.ln_f(x))


class NormGeoForCausalLM(NormGeoPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: NormGeoConfig) -> None:
        super().__init__(config)
        self.transformer = NormGeoModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> CausalLMOutput:
        hidden = self.transformer(input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
