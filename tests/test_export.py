"""The arms leave the harness with the same logits: Hugging Face, TransformerLens, nnsight; the tokenizer."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from models.export.hf import class_source, hf_class_name, load_hf, model_code, save_hf, to_hf
from models.export.lens import to_nnsight, to_transformer_lens, transformer_lens_refusal
from models.gpt import GPT, GPTConfig
from models.norms import NORM_ARMS, make_norm

CASES = list(itertools.product(NORM_ARMS, ("pre", "post"), (True, False)))
TOLERANCE = 1e-5  # fp32 max abs logit difference
TL_ARMS = [name for name, arm in NORM_ARMS.items() if arm.transformer_lens is not None]


def perturbed_gpt(norm: str, placement: str = "pre", tie: bool = True, seed: int = 0) -> GPT:
    """A tiny GPT whose every parameter (norm gains, biases and DyT's alpha included) is moved off its init,
    so that a weight landing in the wrong place, transposed or dropped changes the logits."""
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, norm=norm, placement=placement,
                        tie_embeddings=tie), seed=seed).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in gpt.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return gpt


def token_ids() -> torch.Tensor:
    return torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(("norm", "placement", "tie"), CASES)
def test_hf_model_reproduces_the_logits(norm: str, placement: str, tie: bool) -> None:
    gpt = perturbed_gpt(norm, placement, tie)
    ids = token_ids()
    with torch.no_grad():
        assert (to_hf(gpt)(ids).logits - gpt(ids)).abs().max().item() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(("norm", "placement", "tie"), CASES)
def test_hf_export_directory_reproduces_the_logits(norm: str, placement: str, tie: bool, tmp_path) -> None:
    gpt = perturbed_gpt(norm, placement, tie)
    save_hf(gpt, tmp_path)
    model = load_hf(tmp_path)
    ids = token_ids()
    with torch.no_grad():
        diff = (model(ids).logits - gpt(ids)).abs().max().item()
    assert diff <= TOLERANCE
    assert type(model).__name__ == hf_class_name(gpt)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tie
    # A pre-LN LayerNorm arm is plain GPT-2: no model code beside its weights.
    assert (tmp_path / "modeling_normgeo.py").exists() == (type(model).__name__ != "GPT2LMHeadModel")


def test_gpt2_holds_exactly_the_pre_ln_layernorm_arms() -> None:
    held = {
        (n, p)
        for n, p, _ in CASES
        if hf_class_name(GPT(GPTConfig(n_layer=1, n_embd=8, norm=n, placement=p))) == "GPT2LMHeadModel"
    }
    assert {("layer", "pre"), ("layer_nobias", "pre")} <= held
    assert all(p == "pre" and NORM_ARMS[n].module_type is nn.LayerNorm for n, p in held)


def test_the_model_code_defines_each_arm_from_its_registration() -> None:
    """The saved file, run on its own, builds every arm's norm as the harness does: the same class name,
    parameters and outputs (its own copy of the class where the arm's is not torch's)."""
    x = torch.randn(3, 8)
    for norm, arm in NORM_ARMS.items():
        namespace: dict = {"__name__": "saved_model_code"}
        exec(compile(model_code(norm), "modeling_normgeo.py", "exec"), namespace)
        copy = namespace["NORM_CLASSES"][arm.module_type.__name__](**arm.arguments(8, 1e-5, "ln2"))
        ours = make_norm(norm, 8, 1e-5, "ln2")
        copy.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert torch.equal(copy(x), ours(x)), norm
        assert (type(copy) is arm.module_type) == (arm.module_type.__module__.startswith("torch.")), norm


def helper(x: torch.Tensor) -> torch.Tensor:
    return x


class ReadsAHelper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper(x)


def test_the_model_code_refuses_a_class_that_reads_a_function_of_its_module() -> None:
    with pytest.raises(TypeError, match="ReadsAHelper reads helper of its module"):
        class_source(ReadsAHelper)


def test_a_wrong_weight_breaks_parity() -> None:
    """The parity check can fail: one norm gain changed after export moves the logits far past the
    tolerance."""
    gpt = perturbed_gpt("rms", "pre", True)
    model = to_hf(gpt)
    with torch.no_grad():
        model.transformer.blocks[1].ln2.weight.mul_(1.5)
        assert (model(token_ids()).logits - gpt(token_ids())).abs().max().item() > 100 * TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(("norm", "tie"), list(itertools.product(TL_ARMS, (True, False))))
def test_transformer_lens_reproduces_the_logits(norm: str, tie: bool) -> None:
    gpt = perturbed_gpt(norm, "pre", tie)
    with torch.no_grad():
        diff = (to_transformer_lens(gpt)(token_ids()) - gpt(token_ids())).abs().max().item()
    assert diff <= TOLERANCE


@pytest.mark.parametrize(("norm", "placement"), [(n, p) for n, p, t in CASES if t and (n, p) not in
                                                 {(a, "pre") for a in TL_ARMS}])
def test_transformer_lens_refuses_the_arms_it_cannot_hold(norm: str, placement: str) -> None:
    gpt = perturbed_gpt(norm, placement)
    reason = transformer_lens_refusal(gpt.config)
    assert reason and "--to hf" in reason
    with pytest.raises(ValueError, match="cannot hold"):
        to_transformer_lens(gpt)


def ones_angle(residual: torch.Tensor) -> float:
    """Mean angle (degrees) of the residual vectors with the uniform vector 1."""
    cos = residual.sum(-1) / (residual.norm(dim=-1) * residual.shape[-1] ** 0.5)
    return torch.rad2deg(torch.arccos(cos.clamp(-1, 1))).mean().item()


@pytest.mark.slow  # imports TransformerLens: seconds
def test_transformer_lens_default_processing_changes_the_angle_with_1_and_the_export_does_not() -> None:
    """TransformerLens' defaults (fold_ln, center_writing_weights, ...) keep the log-probs but make the
    residual stream orthogonal to 1; the export's loading (processing off) keeps the harness's angle."""
    gpt = perturbed_gpt("layer", "pre", False)
    with torch.no_grad():
        gpt.wte.weight.add_(0.05)  # a component along 1 in every token's embedding, as training can leave
    ids = token_ids()
    captured = {}
    hook = gpt.blocks[1].register_forward_pre_hook(lambda _m, args: captured.update(x=args[0]))
    with torch.no_grad():
        logits = gpt(ids)
    hook.remove()
    harness = ones_angle(captured["x"])
    angles = {}
    for process in (False, True):
        model = to_transformer_lens(gpt, process=process)
        with torch.no_grad():
            out, cache = model.run_with_cache(ids, names_filter="blocks.1.hook_resid_pre")
        angles[process] = ones_angle(cache["blocks.1.hook_resid_pre"])
        log_probs = torch.log_softmax(out, -1)
        assert (log_probs - torch.log_softmax(logits, -1)).abs().max().item() < 1e-4
    assert harness < 80  # the model's residual stream is far from orthogonal to 1
    assert abs(angles[False] - harness) < 1e-3
    assert abs(angles[True] - 90.0) < 1e-3


@pytest.mark.slow  # imports nnsight: seconds
@pytest.mark.parametrize(("norm", "placement"), [("layer", "pre"), ("dyt", "post")])
def test_nnsight_traces_the_exported_model(norm: str, placement: str) -> None:
    gpt = perturbed_gpt(norm, placement)
    ids = token_ids()
    hf_model = to_hf(gpt)
    wrapped = to_nnsight(hf_model)
    norm_module = (wrapped.transformer.h[0].ln_1 if type(hf_model).__name__ == "GPT2LMHeadModel"
                   else wrapped.transformer.blocks[0].ln1)
    with torch.no_grad(), wrapped.trace(ids):
        hidden = norm_module.output.save()
        logits = wrapped.output.logits.save()
    assert hidden.shape == (2, 24, 32)
    with torch.no_grad():
        assert (logits - gpt(ids)).abs().max().item() <= TOLERANCE
