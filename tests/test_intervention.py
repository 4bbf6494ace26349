"""The centering intervention (normgeo/measure/intervention.py) against independent computations.

- the intervened forward of our GPT equals a hand-written float64 forward with the norm formula swapped;
- inputs made orthogonal to 1 (TransformerLens' "center writing weights") leave the predictions unchanged;
- a known component along 1 changes the loss exactly as the closed form says, by energy bin and by position;
- at initialization, LayerNorm without its centering *is* RMSNorm (and the reverse);
- hooks leave the model bitwise as it was, also when a forward raises;
- scopes resumed mid-stack equal the full re-run (our GPT, GPT-2 and Llama from transformers), a model that
  cannot be resumed falls back, and the token budget bounds what is intervened on.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from models.gpt import GPT, GPTConfig
from models.pretrained import hf_forward
from normgeo.measure.intervention import (
    ENERGY_EDGES,
    INTERVENTION_FIELDS,
    POSITION_FIELDS,
    CenteringIntervention,
    block_stack,
    intervened,
    intervention_scopes,
    next_token_changes,
    row_argmax,
)
from normgeo.measure.mean_sources import BUCKET_STARTS, DOC_START, bucket_names
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.measure.pipeline import budget_windows, measure_records, run_probe, windows
from normgeo.measure.probe import make_references, residual_norms
from normgeo.measure.probe_config import BootstrapConfig, ProbeConfig
from normgeo.run_folder import INTERVENTION_FILE, INTERVENTION_POSITIONS_FILE

SEQ = 12
WIDTH = 16
VOCAB = 1000  # a small vocabulary keeps the logits cheap; nothing here depends on its size


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread (on a loaded machine, every op's thread barrier can wait
    milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(norm: str, placement: str = "pre", layers: int = 2, seed: int = 0) -> GPT:
    config = GPTConfig(n_layer=layers, n_head=2, n_embd=WIDTH, block_size=SEQ, vocab_size=VOCAB, norm=norm,
                       placement=placement, tie_embeddings=False)
    return GPT(config, seed=seed).eval()


def randomize_norms(model: GPT, seed: int = 1) -> None:
    """Gains away from 1 and biases away from 0, so that no formula is right by accident."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("ln1", "ln2", "ln_f"):
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.copy_(1 + 0.3 * noise if name.endswith("weight") else 0.2 * noise)


def token_ids(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, count)


def probe_files(model: GPT, ids, kinds=("all", "layers"), **kwargs) -> dict[str, list[dict]]:
    """The records files of one probe, by the pipeline the training probe and analyze.py call."""
    probe = ProbeConfig(tokens=len(ids), seed=0, bootstrap=BootstrapConfig(replicates=200),
                        intervention=list(kinds))
    return measure_records(model, ids, SEQ, make_references(WIDTH), probe, batch_size=4, model_name="t",
                           step=0, tokens_per_step=None, **kwargs).files


def records(model: GPT, ids, kinds=("all", "layers"), **kwargs) -> list[dict]:
    """intervention.jsonl's rows of one probe."""
    return probe_files(model, ids, kinds, **kwargs).get(INTERVENTION_FILE, [])


# --- a hand-written GPT forward, in float64 -------------------------------------------------------------


def swapped_norm(x: torch.Tensor, module: torch.nn.Module, eps: float) -> torch.Tensor:
    """The intervened norm by its formula: LayerNorm without centering, RMSNorm with it."""
    gain = module.weight
    bias = getattr(module, "bias", None)
    if isinstance(module, torch.nn.LayerNorm):  # remove the centering
        out = gain * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    else:  # add it
        centred = x - x.mean(-1, keepdim=True)
        out = gain * centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)
    return out + bias if bias is not None else out


def hand_forward(model: GPT, ids: torch.Tensor, swap: set[str]) -> torch.Tensor:
    """Our GPT's logits written out from its weights; the norms named in ``swap`` use :func:`swapped_norm`."""
    config = model.config
    eps = config.norm_eps
    modules = dict(model.named_modules())

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        module = modules[name]
        if name in swap:
            return swapped_norm(x, module, eps)
        return module(x)  # the intact norm: torch's own module

    def attention(block, h: torch.Tensor) -> torch.Tensor:
        batch, seq, width = h.shape
        heads, size = config.n_head, width // config.n_head
        qkv = h @ block.attn.c_attn.weight.T + block.attn.c_attn.bias
        q, k, v = (t.reshape(batch, seq, heads, size).transpose(1, 2) for t in qkv.split(width, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(size)
        scores = scores.masked_fill(torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, width)
        return y @ block.attn.c_proj.weight.T + block.attn.c_proj.bias

    def mlp(block, h: torch.Tensor) -> torch.Tensor:
        u = h @ block.mlp.c_fc.weight.T + block.mlp.c_fc.bias
        u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
        return u @ block.mlp.c_proj.weight.T + block.mlp.c_proj.bias

    x = model.wte.weight[ids] + model.wpe.weight[: ids.shape[1]]
    for index, block in enumerate(model.blocks):
        if config.placement == "post":
            x = norm(f"blocks.{index}.ln1", x + attention(block, x))
            x = norm(f"blocks.{index}.ln2", x + mlp(block, x))
        else:
            x = x + attention(block, norm(f"blocks.{index}.ln1", x))
            x = x + mlp(block, norm(f"blocks.{index}.ln2", x))
    return norm("ln_f", x) @ model.lm_head.weight.T


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("norm", ["layer", "layer_nobias", "rms", "rms_bias"])
def test_intervened_forward_equals_a_hand_written_one(norm: str, placement: str) -> None:
    model = tiny(norm, placement).double()
    randomize_norms(model)
    ids = torch.as_tensor(token_ids(2 * SEQ).reshape(2, SEQ))
    scopes = {scope.name: scope for scope in intervention_scopes(residual_norms(find_norm_sites(model)),
                                                                  ("all", "layers"))}
    with torch.no_grad():
        # the hand forward
        assert torch.allclose(model(ids), hand_forward(model, ids, set()), rtol=0, atol=1e-12)
        for name, swap in (("all", {"blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"}),
                           ("layer 1", {"blocks.1.ln1", "blocks.1.ln2"}), ("layer final", {"ln_f"})):
            with intervened(scopes[name].sites):
                got = model(ids)
            expected = hand_forward(model, ids, swap)
            assert (got - expected).abs().max().item() < 1e-12, name
            assert (got - model(ids)).abs().max().item() > 1e-6, name  # the swap changed something


def center_writing_weights(model: GPT) -> None:
    """Make everything written into the residual stream orthogonal to 1 (embeddings and every output
    projection centred over the model width), so that every pre-norm input is too."""
    with torch.no_grad():
        for embedding in (model.wte.weight, model.wpe.weight):
            embedding -= embedding.mean(dim=1, keepdim=True)
        for block in model.blocks:
            for projection in (block.attn.c_proj, block.mlp.c_proj):
                projection.weight -= projection.weight.mean(dim=0, keepdim=True)
                projection.bias -= projection.bias.mean()


def test_inputs_orthogonal_to_ones_make_removing_the_centering_change_nothing() -> None:
    model = tiny("layer").double()
    randomize_norms(model)
    center_writing_weights(model)
    rows = records(model, token_ids(6 * SEQ))
    assert [row["scope_name"] for row in rows] == ["all", "layer 0", "layer 1", "layer final"]
    for row in rows:
        assert abs(row["delta_loss"]) < 1e-10 and row["kl"] < 1e-12 and row["top1_agreement"] == 1.0
        assert row["delta_loss_ci_low"] <= row["delta_loss"] <= row["delta_loss_ci_high"]
        assert row["energy_bins"][0]["tokens"] == row["tokens"] == 6 * (SEQ - 1)  # every fraction < 1e-4
    # The same weights without the centring: the intervention now does something.
    moved = tiny("layer").double()
    randomize_norms(moved)
    assert abs(records(moved, token_ids(6 * SEQ), kinds=("all",))[0]["delta_loss"]) > 1e-6


def test_a_known_component_along_ones_changes_the_loss_as_the_closed_form_says() -> None:
    """Embeddings z + c 1 with z orthogonal to 1 and no block output: the final LayerNorm sees them as they
    are. Intact it gives g z / sqrt(|z|^2/d + eps) + b; without centering g (z + c 1) / sqrt(|z|^2/d + c^2 +
    eps) + b; the head turns both into logits and the loss change follows."""
    model = tiny("layer", layers=1).double()
    randomize_norms(model)
    d, eps = WIDTH, model.config.norm_eps
    rng = np.random.default_rng(3)
    vocab = model.wte.weight.shape[0]
    z = rng.standard_normal((vocab, d))
    z -= z.mean(axis=1, keepdims=True)
    c = rng.uniform(-1.5, 1.5, size=vocab)
    with torch.no_grad():
        model.wte.weight.copy_(torch.from_numpy(z + c[:, None]))
        model.wpe.weight.zero_()
        for projection in (model.blocks[0].attn.c_proj, model.blocks[0].mlp.c_proj):
            projection.weight.zero_()
            projection.bias.zero_()
    ids = token_ids(5 * SEQ, seed=4)
    # Documents packed across the windows: the stream's first at window 0's position 0, one mid-window 0, one
    # at window 1's position 0 (its separator window 0's last token), one mid window 2, one at window 3's
    # last position (no next token there: no prediction of its own).
    separator = VOCAB - 1
    ids[ids == separator] = 0
    ids[[4, SEQ - 1, 2 * SEQ + 9, 3 * SEQ + 10]] = separator
    starts = np.zeros(len(ids), dtype=bool)
    starts[[0, 5, SEQ, 2 * SEQ + 10, 3 * SEQ + 11]] = True
    files = probe_files(model, ids, kinds=("layers",), separator=separator)
    row = files[INTERVENTION_FILE][-1]
    assert row["scope_name"] == "layer final"

    gain = model.ln_f.weight.detach().numpy()
    bias = model.ln_f.bias.detach().numpy()
    head = model.lm_head.weight.detach().numpy()
    s2 = (z**2).mean(axis=1)  # |z|^2 / d
    intact = gain * z / np.sqrt(s2 + eps)[:, None] + bias
    swapped = gain * (z + c[:, None]) / np.sqrt(s2 + c**2 + eps)[:, None] + bias

    def log_softmax(logits: np.ndarray) -> np.ndarray:
        shifted = logits - logits.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    windows = ids.reshape(5, SEQ)
    current, following = windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)
    p_log, q_log = log_softmax(intact[current] @ head.T), log_softmax(swapped[current] @ head.T)
    picked = np.arange(len(current))
    delta = q_log[picked, following] - p_log[picked, following]
    kl = (np.exp(p_log) * (p_log - q_log)).sum(axis=1)
    assert row["delta_loss"] == pytest.approx(-delta.mean(), abs=1e-9)
    assert row["kl"] == pytest.approx(kl.mean(), rel=1e-9)
    assert row["top1_agreement"] == pytest.approx((p_log.argmax(1) == q_log.argmax(1)).mean())
    # Each token lands in the bin of its energy fraction along 1, c^2 / (|z|^2/d + c^2).
    fraction = c[current] ** 2 / (s2[current] + c[current] ** 2)
    expected_counts = np.histogram(np.clip(fraction, 0, 1 - 1e-12), bins=ENERGY_EDGES)[0]
    assert [b["tokens"] for b in row["energy_bins"]] == expected_counts.tolist()
    for entry, low, high in zip(row["energy_bins"], ENERGY_EDGES[:-1], ENERGY_EDGES[1:], strict=True):
        inside = (fraction >= low) & (fraction < high)
        if inside.any():
            assert entry["delta_loss"] == pytest.approx(-delta[inside].mean(), abs=1e-9)
            assert entry["mean_fraction"] == pytest.approx(fraction[inside].mean(), rel=1e-6)
    # By the position of the predicting token in its window: the same changes, bucketed.
    *by_position, doc = [r for r in files[INTERVENTION_POSITIONS_FILE] if r["scope_name"] == "layer final"]
    assert [r["bucket"] for r in by_position] == bucket_names() and doc["bucket"] == DOC_START
    assert all(list(r) == list(POSITION_FIELDS) for r in [*by_position, doc])
    loss_change, kl, agree = -delta.reshape(5, SEQ - 1), kl.reshape(5, SEQ - 1), (
        p_log.argmax(1) == q_log.argmax(1)).reshape(5, SEQ - 1)
    ends = [*BUCKET_STARTS[1:], None]
    for entry, start, end in zip(by_position, BUCKET_STARTS, ends, strict=True):
        inside = slice(start, end)
        assert entry["tokens"] == loss_change[:, inside].size
        if not entry["tokens"]:  # beyond the windows
            assert entry["delta_loss"] is None and entry["delta_loss_share"] == 0
            continue
        assert entry["delta_loss"] == pytest.approx(loss_change[:, inside].mean(), abs=1e-9)
        assert entry["kl"] == pytest.approx(kl[:, inside].mean(), rel=1e-9)
        assert entry["top1_agreement"] == pytest.approx(agree[:, inside].mean())
        assert entry["delta_loss_share"] == pytest.approx(
            loss_change[:, inside].sum() / loss_change.sum(), rel=1e-7)
        assert entry["delta_loss_ci_low"] <= entry["delta_loss"] <= entry["delta_loss_ci_high"]
    assert sum(r["kl_share"] for r in by_position) == pytest.approx(1.0)  # the window positions alone
    # The predictions made at the first token of a document, wherever it falls in its window.
    predicting = starts.reshape(5, SEQ)[:, :-1]
    assert (doc["first_position"], doc["last_position"]) == (None, None)
    assert (doc["tokens"], doc["sequences"]) == (4, 3)  # windows 0 (2), 1 and 2; window 3's has no prediction
    assert doc["delta_loss"] == pytest.approx(loss_change[predicting].mean(), abs=1e-9)
    assert doc["kl"] == pytest.approx(kl[predicting].mean(), rel=1e-9)
    assert doc["top1_agreement"] == pytest.approx(agree[predicting].mean())
    share = loss_change[predicting].sum() / loss_change.sum()  # of the scope's whole change
    assert doc["delta_loss_share"] == pytest.approx(share, rel=1e-7)
    assert doc["kl_share"] == pytest.approx(kl[predicting].sum() / kl.sum(), rel=1e-7)
    # Drawn from 3 of the 5 windows: the replicates that drew none are left out of the interval.
    assert doc["delta_loss_ci_low"] < doc["delta_loss"] < doc["delta_loss_ci_high"]
    # Document starts in one window only: every replicate that draws them draws the same tokens (an interval
    # of width 0), so the bounds are null and the mean stays.
    single = ids.copy()
    single[single == separator] = 0
    single[4] = separator
    one = [r for r in probe_files(model, single, kinds=("layers",), separator=separator)[
        INTERVENTION_POSITIONS_FILE] if r["bucket"] == DOC_START]
    assert [(r["tokens"], r["sequences"]) for r in one] == [(2, 1)] * 2
    assert all(r["delta_loss"] is not None and r["delta_loss_ci_low"] is None and r["kl_ci_high"] is None
               for r in one)
    # Without a separator the document starts are unknown: their row is empty and nothing else changes.
    unknown = probe_files(model, ids, kinds=("layers",))
    assert unknown[INTERVENTION_FILE] == files[INTERVENTION_FILE]
    positions, known = unknown[INTERVENTION_POSITIONS_FILE], files[INTERVENTION_POSITIONS_FILE]
    assert [r for r in positions if r["bucket"] != DOC_START] == [
        r for r in known if r["bucket"] != DOC_START]
    empty = [r for r in positions if r["bucket"] == DOC_START]
    assert [r["scope_name"] for r in empty] == ["layer 0", "layer final"]  # one per scope
    assert all(r["tokens"] == 0 for r in empty)
    assert all(r[name] is None for r in empty
               for name in ("delta_loss", "kl", "delta_loss_ci_low", "delta_loss_share", "kl_share"))


def test_at_initialization_layernorm_without_centering_is_rmsnorm() -> None:
    """Same seed, same non-norm weights, gains 1 and biases 0: removing LayerNorm's centering gives the
    RMSNorm arm's logits and adding it to RMSNorm gives the LayerNorm arm's (both use eps the same way)."""
    layer, rms = tiny("layer"), tiny("rms")
    ids = torch.as_tensor(token_ids(3 * SEQ).reshape(3, SEQ))
    with torch.no_grad():
        with intervened(residual_norms(find_norm_sites(layer))):
            uncentered = layer(ids)
        with intervened(residual_norms(find_norm_sites(rms))):
            centered = rms(ids)
        torch.testing.assert_close(uncentered, rms(ids), rtol=0, atol=2e-5)
        torch.testing.assert_close(centered, layer(ids), rtol=0, atol=2e-5)
    # So the two arms' records mirror each other: Δ loss of removing = - Δ loss of adding.
    removed, added = (
        records(layer, ids.numpy().reshape(-1), kinds=("all",)),
        records(rms, ids.numpy().reshape(-1), kinds=("all",)),
    )
    assert removed[0]["action"] == "remove" and added[0]["action"] == "add"
    assert removed[0]["delta_loss"] == pytest.approx(-added[0]["delta_loss"], abs=1e-5)


def state(model: GPT) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def no_hooks(model: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_hooks_leave_the_model_bitwise_as_it_was_also_when_a_forward_raises() -> None:
    model = tiny("layer")
    randomize_norms(model)
    ids = torch.as_tensor(token_ids(2 * SEQ).reshape(2, SEQ))
    before, weights = model(ids).detach(), state(model)
    records(model, ids.numpy().reshape(-1))
    assert no_hooks(model) and torch.equal(model(ids), before)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())

    blocks = list(model.blocks)
    # Forwards: 1 intact, 2 the resumed-forward check, 3 scope "all", 4 "layer 0", 5 "layer 1": resumed at
    # block 1, so block 0 is swapped for its recorded output while the norm hooks are in place.
    for failing_call in (3, 5):
        calls = []

        def failing_forward(
            batch: torch.Tensor, failing_call: int = failing_call, calls: list = calls
        ) -> torch.Tensor:
            calls.append(len(calls))
            if len(calls) == failing_call:
                raise RuntimeError("a forward failed")
            return model(batch)

        with pytest.raises(RuntimeError, match="a forward failed"):
            records(model, ids.numpy().reshape(-1), forward=failing_forward)
        assert len(calls) == failing_call and no_hooks(model)
        assert all(a is b for a, b in zip(model.blocks, blocks, strict=True))
    assert torch.equal(model(ids), before)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_scopes_rows_and_their_contract() -> None:
    norms = residual_norms(find_norm_sites(tiny("rms")))
    names = [s.name for s in intervention_scopes(norms, ("all", "layers", "site_classes"))]
    assert names == ["all", "layer 0", "layer 1", "layer final", "ln1", "ln2", "final"]
    assert intervention_scopes(residual_norms(find_norm_sites(tiny("dyt")))) == []  # DyT: nothing to centre
    with pytest.raises(ValueError, match="unknown intervention scope"):
        intervention_scopes(norms, ("everything",))
    rows = records(tiny("rms"), token_ids(3 * SEQ + 5), kinds=("all", "site_classes"))
    assert [tuple(r) for r in rows] == [INTERVENTION_FIELDS] * 4
    every = rows[0]
    assert every["sites"] == ["0.ln1", "0.ln2", "1.ln1", "1.ln2", "final"] and every["action"] == "add"
    assert every["tokens"] == 3 * (SEQ - 1) + 4 and every["sequences"] == 4  # the 5-token tail window too
    assert sum(b["tokens"] for b in every["energy_bins"]) == every["tokens"]
    assert every["output"] == "next_token" and every["cosine"] is None
    assert (
        0 <= every["top1_agreement_ci_low"] <= every["top1_agreement"] <= every["top1_agreement_ci_high"] <= 1
    )
    assert records(tiny("dyt"), token_ids(3 * SEQ)) == []
    assert records(tiny("rms"), token_ids(3 * SEQ), kinds=()) == []


# --- resumed mid-stack and the token budget --------------------------------------------------------------

def scope_rows(model: torch.nn.Module, ids: np.ndarray, *, resume: bool, budget: int | None = None,
               forward=None) -> tuple[list[dict], CenteringIntervention]:
    """intervention.jsonl's rows with every scope (all, each block, each site class), resumed or re-run."""
    parts = windows(ids, SEQ)
    norms = residual_norms(find_norm_sites(model))
    count, tokens = budget_windows(parts, budget)
    scopes = intervention_scopes(norms, ("all", "layers", "site_classes"))
    intervention = CenteringIntervention(model, norms, scopes, count, token_budget=tokens, resume=resume,
                                         bootstrap_replicates=200)
    run_probe(model, parts, [intervention], norms=norms, batch_size=4, forward=forward)
    keys = {"model": "t", "norm": "x", "step": None, "tokens_seen": None}
    return intervention.records(keys)[INTERVENTION_FILE], intervention


def assert_same_rows(resumed: list[dict], rerun: list[dict]) -> None:
    assert [r["scope_name"] for r in resumed] == [r["scope_name"] for r in rerun]
    for a, b in zip(resumed, rerun, strict=True):
        for name in ("delta_loss", "kl", "top1_agreement", "cosine", "loss_intact", "tokens", "sequences"):
            if b[name] is None:
                assert a[name] is None
            else:  # float32 forwards of the same operations on the same inputs: equal to float precision
                assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (a["scope_name"], name)


def block_calls(blocks: torch.nn.ModuleList) -> list[int]:
    calls = [0]
    for block in blocks:
        block.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(("norm", "placement"), [("layer", "pre"), ("rms", "pre"), ("layer", "post")])
def test_scopes_resumed_mid_stack_equal_the_full_rerun_on_our_gpt(norm: str, placement: str) -> None:
    layers = 3
    model = tiny(norm, placement, layers=layers)
    randomize_norms(model)
    ids = token_ids(5 * SEQ + 3)
    calls = block_calls(model.blocks)
    resumed, intervention = scope_rows(model, ids, resume=True)
    assert intervention.replay is not None  # it did resume: no fallback
    # Per batch (3: 4 windows, 1, then the 3-token tail): the intact forward, "all"
    # and 3 site classes in full, and each block's scope from its own block on (final:
    # no block at all); once, the check resumed at block 1.
    per_batch = layers + 4 * layers + sum(layers - block for block in range(layers))
    assert calls[0] == 3 * per_batch + (layers - layers // 2)
    calls[0] = 0
    rerun, intervention = scope_rows(model, ids, resume=False)
    assert intervention.replay is None and calls[0] == 3 * (layers + 4 * layers + (layers + 1) * layers)
    assert_same_rows(resumed, rerun)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_scopes_resumed_mid_stack_equal_the_full_rerun_on_hugging_face_models(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=3, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=SEQ)
        model, blocks = transformers.GPT2LMHeadModel(config).eval(), "transformer.h"
    else:
        config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=WIDTH, intermediate_size=32,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=SEQ)
        model, blocks = transformers.LlamaForCausalLM(config).eval(), "model.layers"
    with torch.no_grad():  # norms away from their initial gain 1 and bias 0
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                param.add_(0.3 * torch.randn_like(param))
    ids = token_ids(5 * SEQ + 3)
    resumed, intervention = scope_rows(model, ids, resume=True, forward=hf_forward(model))
    assert intervention.replay is not None and intervention.replay.stack is model.get_submodule(blocks)
    rerun, _ = scope_rows(model, ids, resume=False, forward=hf_forward(model))
    assert_same_rows(resumed, rerun)
    assert any(abs(r["delta_loss"]) > 1e-4 for r in rerun)  # the scopes change something: not trivially equal


def test_a_model_that_cannot_be_resumed_falls_back_to_the_full_forward_and_says_so(caplog) -> None:
    model = tiny("layer", layers=3)
    randomize_norms(model)

    def leaky_forward(batch: torch.Tensor) -> torch.Tensor:
        # A forward whose result depends on more than the blocks' outputs (state kept outside them).
        leaky_forward.count += 1
        return model(batch) + 0.5 * leaky_forward.count

    leaky_forward.count = 0
    with caplog.at_level("WARNING"):
        rows, intervention = scope_rows(model, token_ids(4 * SEQ), resume=True, forward=leaky_forward)
    assert intervention.replay is None and no_hooks(model)
    assert [r.message for r in caplog.records].count(
        "centering intervention: the model cannot be resumed mid-stack (a forward resumed at block 1 "
        "does not "
        "reproduce the intact forward); each of its per-block scopes runs the full forward"
    ) == 1


def test_the_intervention_runs_on_its_token_budget_and_the_rows_say_so() -> None:
    model = tiny("rms", layers=2)
    ids = token_ids(10 * SEQ)
    calls = block_calls(model.blocks)
    rows, _ = scope_rows(model, ids, resume=True, budget=5 * SEQ - 1)  # rounded up to whole windows: 5
    assert {r["intervention_tokens"] for r in rows} == {5 * SEQ}
    assert {(r["tokens"], r["sequences"]) for r in rows} == {(5 * (SEQ - 1), 5)}
    # Batches of 4 windows: 3 intact forwards; the scopes ("all" and 3 site classes in full, blocks 0 and 1
    # resumed) on the first two batches only; once, the check resumed at block 1.
    assert calls[0] == 3 * 2 + 2 * (4 * 2 + (2 + 1)) + 1
    whole, _ = scope_rows(model, ids[: 5 * SEQ], resume=True)
    assert_same_rows(rows, whole)  # the same windows measured alone give the same rows


def test_past_the_budget_the_probe_runs_the_model_without_its_head_and_measures_the_same() -> None:
    """The batches the intervention does not intervene on are measured through ``headless`` (the model up to
    its last norm): the LM head runs only for the intervened batches, and every record is the same bits."""
    model = tiny("layer", layers=2)
    ids = token_ids(10 * SEQ)
    heads = []
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: heads.append(len(output)))
    probe = ProbeConfig(tokens=len(ids), seed=0, bootstrap=BootstrapConfig(replicates=50),
                        intervention=["all"], intervention_tokens=3 * SEQ)
    measured = {}
    try:
        for name, headless in (("with the head", None), ("headless", model.hidden)):
            heads.clear()
            measured[name] = measure_records(model, ids, SEQ, make_references(WIDTH), probe, batch_size=2,
                                             model_name="t", step=0, tokens_per_step=None, headless=headless,
                                             separator=VOCAB - 1).files
            measured[name + " heads"] = list(heads)
    finally:
        handle.remove()
    # 5 batches of 2 windows; the budget's 3 windows are in the first 2: their intact forwards, the scope's.
    assert len(measured["with the head heads"]) == 5 + 2 and len(measured["headless heads"]) == 2 + 2
    assert json.dumps(measured["headless"]) == json.dumps(measured["with the head"])  # NaN as NaN


def test_the_progress_bar_counts_forwards_and_ends_at_its_total(capsys) -> None:
    model = tiny("layer", layers=3)
    ids = token_ids(9 * SEQ)
    parts, norms = windows(ids, SEQ), residual_norms(find_norm_sites(model))
    scopes = intervention_scopes(norms, ("all", "layers"))
    intervention = CenteringIntervention(model, norms, scopes, 9, token_budget=9 * SEQ)
    run_probe(model, parts, [intervention], norms=norms, batch_size=4, progress=True)
    bars = re.findall(r"(\d+\.\d)/([\d.]+) forwards", capsys.readouterr().err)
    # 3 batches, each: the intact forward, "all" and the 4 resumed block scopes at (L - l + 1) / (L + 1).
    total = 3 * (1 + 1 + sum((3 - layer + 1) / 4 for layer in range(4)))
    assert float(bars[-1][0]) == pytest.approx(total, abs=0.05) and float(bars[-1][1]) == pytest.approx(
        total, abs=0.05
    )
    assert len({n for n, _ in bars}) > 3  # it moved within the batches, not only after each


def test_the_block_list_is_found_from_the_norms_and_two_stacks_are_not_resumed() -> None:
    transformers = pytest.importorskip("transformers")
    model = tiny("rms", layers=3)
    assert block_stack(model, residual_norms(find_norm_sites(model))) == (model.blocks, "")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2))
    stack, why = block_stack(t5, residual_norms(find_norm_sites(t5)))
    assert stack is None and why == "its norms are in more than one block list"


@pytest.mark.parametrize("change", [0.3, 0.01])
def test_the_vocabulary_work_matches_float64_for_large_logits(change: float) -> None:
    """Loss change, KL and top-1 agreement of float32 logits far from 0 (as a trained model's are), against a
    float64 computation, to 1e-4 of the KL also where it is 1e-3 of the logits' float32 rounding (a change of
    0.01: KL 4e-5; as a difference of O(10) sums it was off by 1e-6, and by the CPU's summation order)."""
    generator = torch.Generator().manual_seed(0)
    intact_logits = 10 + 4 * torch.randn(2, 200, 5000, generator=generator)
    intervened_logits = intact_logits + change * torch.randn(2, 200, 5000, generator=generator)
    tokens = torch.randint(0, 5000, (2, 200), generator=generator)
    changes = next_token_changes(intact_logits, intervened_logits, tokens).double()
    p, q = (torch.log_softmax(x[:, :-1].double(), dim=-1) for x in (intact_logits, intervened_logits))
    targets = tokens[:, 1:].unsqueeze(-1)
    torch.testing.assert_close(changes[..., 1], (p.exp() * (p - q)).sum(-1), rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(changes[..., 3], -p.gather(-1, targets).squeeze(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(changes[..., 0], (p - q).gather(-1, targets).squeeze(-1), rtol=0, atol=1e-6)
    assert torch.equal(changes[..., 2], (p.argmax(-1) == q.argmax(-1)).double())


@pytest.mark.parametrize("width", [5000, 4096, 40])
def test_the_argmax_through_block_maxima_is_torchs_first_maximal_index(width: int) -> None:
    """Ties (the first index wins, also across blocks), a NaN (counted as the maximum, the first one), a
    maximum in a short last block or at the last index, and rows narrower than one block."""
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(0))
    x[1, [7, 3, width - 1]] = 50.0  # a tie across blocks
    x[2, :] = 1.0  # every entry the maximum
    x[3, [width // 2, width - 2]] = math.nan
    x[4, width - 1] = 60.0
    x[5, width - width % 64 if width % 64 else width - 64] = 70.0  # the first entry of the last block
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
