"""The 2x2 norm factorial, the Pre-/Post-LN placement, Riechers' output ellipsoid and the energy along 1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from models.gpt import GPT, GPTConfig
from models.norms import NORM_ARMS, DynamicTanh, RMSNormWithBias, make_norm
from normgeo.measure.ellipsoid import ellipsoid_rows, norm_geometry, principal_axes, semi_axes
from normgeo.measure.energy import QUANTITIES, EnergyStatistics
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.measure.pipeline import probe_angles
from normgeo.measure.probe import make_references, residual_norms
from normgeo.measure.records import read_rows
from normgeo.measure.stats import QUANTILES
from tests.conftest import run_train, train_here, train_in_process


def tiny(norm: str, placement: str = "pre") -> GPT:
    return GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, norm=norm, placement=placement), seed=0
    )


def test_the_factorial_cells_are_centering_times_bias() -> None:
    cells = {kind: make_norm(kind, 8, 1e-5) for kind in NORM_ARMS}
    assert isinstance(cells["layer_nobias"], nn.LayerNorm) and cells["layer_nobias"].bias is None
    assert isinstance(cells["rms_bias"], RMSNormWithBias) and cells["rms_bias"].bias.shape == (8,)
    factorial = {(NORM_ARMS[kind].centres, NORM_ARMS[kind].has_bias): kind
                 for kind in ("layer", "layer_nobias", "rms", "rms_bias")}
    assert factorial == {(True, True): "layer", (True, False): "layer_nobias", (False, False): "rms",
                         (False, True): "rms_bias"}
    for kind, arm in NORM_ARMS.items():  # the probe finds every arm's norms as the kind it registers
        assert {site.kind for site in find_norm_sites(tiny(kind))} == {arm.site_kind}, kind
        assert arm.has_bias == (getattr(cells[kind], "bias", None) is not None), kind
    assert isinstance(cells["dyt"], DynamicTanh) and cells["dyt"].alpha.shape == (1,)
    assert NORM_ARMS["dyt"].site_kind == "tanh" and not NORM_ARMS["dyt"].centres
    x = torch.randn(5, 8)
    with torch.no_grad():
        cells["rms_bias"].bias.fill_(0.5)  # the bias is added after the RMS scaling
        assert torch.allclose(cells["rms_bias"](x), nn.RMSNorm(8, eps=1e-5)(x) + 0.5)


def test_post_norm_normalizes_the_residual_stream_after_each_add() -> None:
    pre, post = tiny("layer", "pre"), tiny("layer", "post")
    idx = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(pre(idx), post(idx))
    block, x = post.blocks[0], torch.randn(2, 16, 32)
    seen = {}
    block.ln1.register_forward_hook(lambda m, i, o: seen.setdefault("ln1.in", i[0]))
    block(x)
    assert torch.allclose(seen["ln1.in"], x + block.attn(x))  # under post, ln1.in = residual + attention
    with pytest.raises(ValueError, match="placement='sandwich': expected one of pre, post"):
        GPTConfig(placement="sandwich")


def test_ellipsoid_matches_layernorm_outputs_brute_force() -> None:
    n, generator = 6, torch.Generator().manual_seed(1)
    norm = nn.LayerNorm(n, eps=1e-12, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=generator, dtype=torch.float64) * 2.5 + 0.2)
        norm.bias.copy_(torch.randn(n, generator=generator, dtype=torch.float64))
    with torch.no_grad():
        offsets = norm(torch.randn(200_000, n, generator=generator, dtype=torch.float64)) - norm.bias
    lengths, directions = principal_axes(norm.weight, centered=True)
    assert torch.allclose(lengths, semi_axes(norm.weight, centered=True))
    # On the ellipsoid: sum_k (u_k . w / a_k)^2 = 1 for every output, and in the hyperplane normal to 1/gain.
    assert torch.allclose(
        ((offsets @ directions) / lengths).square().sum(dim=1),
        torch.ones(len(offsets), dtype=torch.float64),
        atol=1e-9,
    )
    assert (offsets @ (1 / norm.weight.detach())).abs().max() < 1e-9
    # The extreme axes are the outputs' extreme extents (a random sample gets within 2% of them).
    extents = offsets.norm(dim=1)
    assert extents.min() >= lengths[0] * (1 - 1e-9) and extents.max() <= lengths[-1] * (1 + 1e-9)
    assert extents.min() <= lengths[0] * 1.02 and extents.max() >= lengths[-1] * 0.98
    # At gain 1 it is the paper's sphere of radius sqrt(N) in 1^perp; an RMSNorm's axes are sqrt(N)|g_i|.
    assert torch.allclose(
        semi_axes(torch.ones(n), centered=True), torch.full((n - 1,), math.sqrt(n), dtype=torch.float64)
    )
    gain = torch.tensor([0.5, -2.0, 1.0])
    assert torch.allclose(
        semi_axes(gain, centered=False), math.sqrt(3) * torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    )


def test_ellipsoid_records_per_norm() -> None:
    record = norm_geometry(torch.tensor([1.0, 1.0, 2.0, 2.0]), torch.ones(4), centered=True)
    assert record["axes_dim"] == 3 and record["bias_ones_deg"] == pytest.approx(0.0, abs=1e-6)
    assert record["condition"] == pytest.approx(record["semi_axis_max"] / record["semi_axis_min"])
    assert 0 < record["normal_ones_deg"] < 90
    rows = ellipsoid_rows(
        residual_norms(find_norm_sites(tiny("rms"))), model="m", norm="rms", step=0, tokens_seen=0
    )
    assert len(rows) == 5 and all(r["condition"] == 1 and r["normal_ones_deg"] is None for r in rows)
    assert all(
        r["bias_ones_deg"] is None and r["semi_axis_max"] == pytest.approx(math.sqrt(32)) for r in rows
    )


def test_energy_fraction_matches_a_direct_computation() -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3000, 16, generator=generator) + 0.3 * torch.randn(3000, 1, generator=generator)
    x[5] = 0  # a zero vector has no direction: not counted
    stats, other = EnergyStatistics(1), EnergyStatistics(1)
    stats.update(0, x[:1000])
    other.update(0, x[1000:])
    stats.merge(other)
    kept = x[x.norm(dim=1) > 0].double()
    direct = torch.stack([(kept @ torch.ones(16, dtype=torch.float64) / (4 * kept.norm(dim=1))).square(),
                          4 / kept.norm(dim=1)], dim=1)
    assert stats.count[0].tolist() == [2999, 2999]
    assert torch.allclose(stats.mean[0], direct.mean(dim=0)) and torch.allclose(
        stats.std()[0], direct.std(dim=0, correction=0)
    )
    quantiles = stats.quantiles()[0]
    ranks = [math.ceil(q * len(kept)) - 1 for q in QUANTILES]  # the order statistic each quantile lands on
    for q, name in enumerate(QUANTITIES):
        exact = direct[:, q].sort().values[ranks]
        ratio = quantiles[q] / exact  # in that value's log-bin: within a factor 10^(1/100)
        assert ((ratio > 10**-0.0101) & (ratio < 10**0.0101)).all(), (name, ratio)


def test_probe_streams_energy_at_every_norm_input() -> None:
    model = tiny("layer_nobias", "post")
    norms = residual_norms(find_norm_sites(model))
    energy = EnergyStatistics(len(norms))
    sequences = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(3))
    probe_angles(model, sequences, make_references(32, null_directions=0), norms=norms, energy=energy)
    assert energy.count[:, 0].tolist() == [48.0] * len(norms)
    inputs = {}
    model.blocks[1].ln2.register_forward_hook(lambda m, i, o: inputs.setdefault("x", i[0]))
    with torch.no_grad():
        model(sequences)
    expected = EnergyStatistics.quantities(inputs["x"])[:, 0].mean()
    assert energy.mean[3, 0] == pytest.approx(float(expected), rel=1e-9)


@pytest.mark.slow
def test_smoke_factorial_cell_post_norm_writes_the_new_records(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    train_here(run_dir, "norm=rms_bias", "placement=post", "max_steps=2", "checkpoint.steps=[2]")
    ellipsoid, energy = read_rows(run_dir / "ellipsoid.jsonl"), read_rows(run_dir / "energy.jsonl")
    assert sorted({r["step"] for r in ellipsoid}) == [0, 2] and {r["norm"] for r in ellipsoid} == {"rms_bias"}
    assert len([r for r in ellipsoid if r["step"] == 2]) == 2 * 2 + 1  # ln1, ln2 per block and ln_f
    assert all(r["bias_ones_deg"] is not None for r in ellipsoid if r["step"] == 2)  # the bias has moved
    assert {r["quantity"] for r in energy} == set(QUANTITIES) and all(0 <= r["mean"] <= 1 for r in energy
                                                                        if r["quantity"] == "ones_fraction")
    refused = train_in_process(tmp_path / "bad", "placement=sandwich", capsys=capsys)
    assert refused.returncode != 0 and "placement" in refused.stderr


def test_dyt_squashes_with_a_learned_alpha_and_is_found_as_a_norm() -> None:
    model = tiny("dyt")
    sites = find_norm_sites(model)
    assert [s.kind for s in sites] == ["tanh"] * 5 and {s.role for s in sites} == {"ln1", "ln2", "final"}
    # The DyT paper's LLM initialisation: alpha0 higher at the attention norm than elsewhere; gain 1, bias 0.
    assert model.blocks[0].ln1.alpha.item() == pytest.approx(
        0.8
    ) and model.ln_f.alpha.item() == pytest.approx(0.2)
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.allclose(model.blocks[0].ln2(x), torch.tanh(0.2 * x))
    # alpha is learned: it gets a gradient.
    model(torch.randint(0, 1000, (2, 16)), torch.randint(0, 1000, (2, 16))).backward()
    assert model.blocks[0].ln1.alpha.grad is not None and model.blocks[0].ln1.alpha.grad.abs().item() > 0


@pytest.mark.slow
def test_smoke_dyt_trains_and_probes_without_std_sites_or_ellipsoid(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train_here(run_dir, "norm=dyt", "max_steps=2", "checkpoint.steps=[2]")
    rows = read_rows(run_dir / "angles.jsonl")
    assert {r["norm"] for r in rows} == {"dyt"} and sorted({r["step"] for r in rows}) == [0, 2]
    assert {r["site"].rpartition(".")[2] for r in rows} == {"in", "out"}  # no standardized input for DyT
    assert read_rows(run_dir / "ellipsoid.jsonl") == []
    energy = read_rows(run_dir / "energy.jsonl")
    assert len([r for r in energy if r["step"] == 2 and r["quantity"] == "ones_fraction"]) == 5
    assert read_rows(run_dir / "null.jsonl")


@pytest.mark.slow
def test_smoke_trains_with_compiled_norms_and_writes_the_stock_checkpoint(tmp_path: Path) -> None:
    """norm.impl=compiled through train.py: trains, the probe finds every norm, the checkpoint loads as
    stock."""
    run_dir = tmp_path / "run"
    run_train(run_dir, "norm=rms", "norm.impl=compiled", "max_steps=2", "checkpoint.steps=[2]")
    rows = read_rows(run_dir / "angles.jsonl")
    assert {r["norm"] for r in rows} == {"rms"} and sorted({r["step"] for r in rows}) == [0, 2]
    assert (
        len({r["site"] for r in rows if r["step"] == 2})
        == len({r["site"] for r in rows if r["step"] == 0})
        > 0
    )
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["gpt_config"]["norm_impl"] == "compiled"
    stock = GPT(GPTConfig(**{**checkpoint["gpt_config"], "norm_impl": "stock"}))
    assert sorted(checkpoint["state_dict"]) == sorted(f"model.{name}" for name in stock.state_dict())


@pytest.mark.slow
def test_compiled_norms_without_a_compiler_are_refused_at_the_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_train(run_dir, "norm.impl=compiled", check=False, env={"CXX": str(tmp_path / "no-such-g++")})
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "norm.impl=compiled: torch.compile needs a C++ compiler for CPU kernels and none works here "
        "(install g++ "
        "or set CXX); or train with norm.impl=stock"
    ) in done.stderr
    assert not run_dir.exists()
