"""A Pre-LN LayerNorm arm converted to RMSNorm (``to_hf(gpt, as_rms=True)``) has the original's logits.

The trained-checkpoint and command-line tests are in tests/test_export_cli.py (they reuse its trained runs).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from models.export.hf import (
    convertible_arms,
    hf_class_name,
    load_hf,
    rms_conversion_refusal,
    rms_parity,
    rms_weights,
    save_hf,
    to_hf,
)
from models.gpt import GPT, GPTConfig
from normgeo.export import ones_energy_and_centering
from tests.test_export import token_ids

FLOAT64_RELATIVE = 1e-10  # max |converted - original| / max |original|, float64
FLOAT32_MAX_ABS = 1e-5  # max |converted - original|, float32
# arm x tied head x linear biases
CASES = list(itertools.product(convertible_arms(), (True, False), (True, False)))


def off_init_gpt(
    norm: str, tie: bool = True, bias: bool = True, placement: str = "pre", dropout: float = 0.0
) -> GPT:
    """A tiny GPT whose every parameter is moved off its init, with a component along 1 in every embedding row
    (as training leaves one), so an uncentred write or an unfolded gain or bias changes the logits."""
    gpt = GPT(
        GPTConfig(
            n_layer=2,
            n_head=2,
            n_embd=32,
            block_size=32,
            norm=norm,
            tie_embeddings=tie,
            bias=bias,
            placement=placement,
            dropout=dropout,
        )
    ).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in gpt.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
        gpt.wte.weight.add_(0.1)
    return gpt


def probe_ids(seq_len: int = 32) -> torch.Tensor:
    return torch.randint(0, 50257, (4, seq_len), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize(("norm", "tie", "bias"), CASES)
def test_convert_keeps_the_logits_in_float64_and_float32(norm: str, tie: bool, bias: bool) -> None:
    gpt = off_init_gpt(norm, tie, bias)
    parity = rms_parity(gpt, token_ids())
    assert parity.float64_relative <= FLOAT64_RELATIVE
    assert parity.float32_max_abs <= FLOAT32_MAX_ABS
    assert next(gpt.parameters()).dtype == torch.float32  # the original is left as it was
    model = to_hf(gpt, as_rms=True)
    norms = [m for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]
    assert len(norms) == 5 and all(type(m) is nn.RMSNorm and m.eps == gpt.config.norm_eps for m in norms)
    assert all(torch.equal(m.weight, torch.ones(32)) for m in norms)  # gains folded forward
    assert model.lm_head.weight is not model.get_input_embeddings().weight  # the final gain unties the head
    assert (model.lm_head.bias is not None) == (norm == "layer")  # ln_f's bias, folded into the head


def test_convert_centres_every_write_into_the_residual_stream() -> None:
    weights = rms_weights(off_init_gpt("layer"), torch.float64)
    writes = ["wte.weight", "wpe.weight"]
    for i in range(2):
        writes += [
            f"blocks.{i}.{linear}.{kind}"
            for linear in ("attn.c_proj", "mlp.c_proj")
            for kind in ("weight", "bias")
        ]
    for name in writes:
        channels = weights[name].shape[-1] if name.startswith("w") else weights[name].shape[0]
        mean = weights[name].mean(dim=-1 if name.startswith("w") else 0)
        assert channels == 32 and mean.abs().max().item() < 1e-15, name


def test_convert_parity_can_fail_without_the_centring() -> None:
    """Adding a component along 1 back to the converted embedding (the original's, uncentred) moves the
    logits far past the tolerance: the RMSNorm model equals the LayerNorm one only on a mean-zero stream."""
    gpt = off_init_gpt("layer")
    model = to_hf(gpt, as_rms=True)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(0.1)
        assert (model(token_ids()).logits - gpt(token_ids())).abs().max().item() > 1000 * FLOAT32_MAX_ABS


@pytest.mark.parametrize("norm", convertible_arms())
def test_convert_leaves_nothing_along_1_and_add_centering_changes_nothing(norm: str) -> None:
    """The probe on the converted model: energy along 1 at every norm input <= 1e-12 and the intervention
    "add centering" (all norms) Δloss = 0 within float64 error; on the original both are far from 0."""
    gpt = off_init_gpt(norm)
    energy, delta_loss = ones_energy_and_centering(to_hf(gpt, as_rms=True, dtype=torch.float64), probe_ids())
    assert energy <= 1e-12
    assert abs(delta_loss) <= 1e-12
    original_energy, original_delta = ones_energy_and_centering(gpt.double(), probe_ids())
    assert original_energy > 1e-2 and abs(original_delta) > 1e-6


@pytest.mark.parametrize(("norm", "placement", "reason"), [
    ("layer", "post", "only Pre-LN arms convert"), ("layer_nobias", "post", "only Pre-LN arms convert"),
    ("dyt", "pre", "no mean subtraction"), ("dyt", "post", "no mean subtraction"),
    ("rms", "pre", "RMSNorm model already"), ("rms_bias", "pre", "RMSNorm model already"),
])
def test_convert_refuses_what_it_cannot_convert(norm: str, placement: str, reason: str) -> None:
    gpt = off_init_gpt(norm, placement=placement)
    assert reason in rms_conversion_refusal(gpt)
    with pytest.raises(ValueError, match=reason):
        to_hf(gpt, as_rms=True)


def test_convert_refuses_dropout_in_training_mode_only() -> None:
    gpt = off_init_gpt("layer", dropout=0.1)
    assert rms_conversion_refusal(gpt) is None  # eval mode: dropout is off
    gpt.train()
    assert "training mode with dropout 0.1" in rms_conversion_refusal(gpt)
    assert rms_conversion_refusal(off_init_gpt("layer").train()) is None  # training mode, no dropout


@pytest.mark.slow  # saves and loads two Hugging Face directories: seconds
@pytest.mark.parametrize(("norm", "tie", "bias"), [("layer", True, True), ("layer_nobias", False, False)])
def test_convert_directory_loads_with_auto_model_and_keeps_the_logits(norm: str, tie: bool, bias: bool,
                                                                      tmp_path) -> None:
    gpt = off_init_gpt(norm, tie, bias)
    save_hf(gpt, tmp_path, as_rms=True)
    model = load_hf(tmp_path)  # AutoModelForCausalLM, trust_remote_code
    assert type(model).__name__ == hf_class_name(gpt, as_rms=True) == "NormGeoForCausalLM"
    assert model.config.norm == "rms" and model.config.lm_head_bias == (norm == "layer")
    with torch.no_grad():
        assert (model(token_ids()).logits - gpt(token_ids())).abs().max().item() <= FLOAT32_MAX_ABS
