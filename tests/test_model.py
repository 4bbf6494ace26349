"""The model and the controlled-arms identity: only norm parameters may differ between arms."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from models.divergence import Divergence, NonFiniteError
from models.gpt import GPT, PLACEMENTS, GPTConfig, is_norm_parameter
from models.lit import LitGPT, warmup_cosine
from models.norms import NORM_ARMS, NORM_IMPLS
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.config.schema import OptimSchema
from normgeo.measure.norm_sites import find_norm_sites
from normgeo.runs.build import make_module

SIZES = ("tiny", "70m", "160m", "410m", "1b")

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)  # a module built in milliseconds


def build_from_config(*overrides: str) -> GPT:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    return make_module(check_config("train", cfg)).model  # the one cfg -> model map (normgeo/runs/build.py)


@pytest.mark.parametrize("tie", [True, False])
def test_arms_share_every_non_norm_parameter_bitwise(tie: bool) -> None:
    """Every norm arm of the registry x both placements against the LayerNorm Pre-LN arm."""
    layer = dict(build_from_config("norm=layer", f"tie_embeddings={tie}").named_parameters())
    shared = [name for name in layer if not is_norm_parameter(name)]
    assert len(shared) > 10
    norm_modules = {n.rpartition(".")[0] for n in layer if is_norm_parameter(n)}  # blocks.0.ln1, ..., ln_f
    for norm in NORM_ARMS:
        for placement in PLACEMENTS:
            model = build_from_config(f"norm={norm}", f"placement={placement}", f"tie_embeddings={tie}")
            arm = dict(model.named_parameters())
            assert shared == [name for name in arm if not is_norm_parameter(name)], (norm, placement)
            for name in shared:
                assert torch.equal(layer[name], arm[name]), (norm, placement, name)
            # The norm parameters are exactly the ones that differ: at every norm of the LayerNorm arm,
            # the parameters of the arm's own module (gains; biases in the biased cells; DyT's alpha).
            own = dict(NORM_ARMS[norm].build(8, 1e-5, "ln1").named_parameters())
            expected = {f"{site}.{name}" for site in norm_modules for name in own}
            assert {n for n in arm if is_norm_parameter(n)} == expected, (norm, placement)
            # norm.impl=compiled: the same modules, forwards compiled; the same checkpoint
            if placement == "pre":
                stock = model.state_dict()
                compiled = build_from_config(f"norm={norm}", "norm.impl=compiled", f"tie_embeddings={tie}")
                assert compiled.config.norm_impl == "compiled" and list(compiled.state_dict()) == list(
                    stock
                ), norm
                assert all(
                    torch.equal(stock[name], value) for name, value in compiled.state_dict().items()
                ), norm


@pytest.mark.slow
@pytest.mark.parametrize("norm", list(NORM_ARMS))
def test_compiled_norms_give_the_stock_numbers_and_the_probe_sees_them(norm: str) -> None:
    """norm.impl=compiled against stock, every arm: the loss, every gradient, a norm's hooked input and
    output (what the probe sees) to float tolerance, and the same site kinds. About 10 s per arm on CPU."""
    torch._dynamo.reset()  # a fresh compile, so that the compiled arm cannot have run eagerly from a cache
    idx = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in NORM_IMPLS:
        model = GPT(
            GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, norm=norm, norm_impl=impl), seed=0
        )
        with torch.no_grad():  # norm parameters away from their init (gain 1, bias 0), the same in both
            for name, param in model.named_parameters():
                if is_norm_parameter(name):
                    param.add_(
                        0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name)))
                    )
        hooked: list[tuple[torch.Tensor, torch.Tensor]] = []
        model.blocks[1].ln2.register_forward_hook(
            lambda module, args, out, seen=hooked: seen.append((args[0], out))
        )
        frames = counters["frames"]["ok"]
        loss = model(idx, idx)
        loss.backward()
        assert (counters["frames"]["ok"] > frames) == (impl == "compiled"), impl  # compiled frames ran
        grads = {name: param.grad for name, param in model.named_parameters()}
        results[impl] = (loss.detach(), grads, list(hooked), [site.kind for site in find_norm_sites(model)])
        if impl == "compiled":  # a copy's compiled forwards run on the copy's parameters, not the original's
            clone = copy.deepcopy(model)
            assert all(norm.forward.__self__ is norm for norm in (clone.ln_f, clone.blocks[0].ln1))
            with torch.no_grad():
                torch.testing.assert_close(clone(idx, idx), loss.detach())
    (loss, grads, hooked, kinds), (loss_c, grads_c, hooked_c, kinds_c) = results["stock"], results["compiled"]
    assert kinds_c == kinds and len(hooked_c) == len(hooked) == 1
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(hooked_c[0][0], hooked[0][0])
    torch.testing.assert_close(hooked_c[0][1], hooked[0][1])
    assert list(grads_c) == list(grads)
    for name in grads:
        torch.testing.assert_close(
            grads_c[name], grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_different_seeds_give_different_weights() -> None:
    a = build_from_config("seed=0")
    b = build_from_config("seed=1")
    assert not torch.equal(a.wte.weight, b.wte.weight)


def test_norm_modules_are_torch_norms_with_the_configured_eps() -> None:
    layer, rms = build_from_config("norm=layer"), build_from_config("norm=rms")
    assert isinstance(layer.blocks[0].ln1, torch.nn.LayerNorm) and layer.blocks[0].ln1.bias is not None
    assert isinstance(rms.ln_f, torch.nn.RMSNorm) and rms.ln_f.eps == 1e-5
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in rms.modules())


def test_vocabulary_is_padded_and_tied() -> None:
    model = build_from_config("tie_embeddings=true")
    assert model.wte.weight.shape[0] == 50304 and 50304 % 64 == 0
    assert model.lm_head.weight is model.wte.weight
    untied = build_from_config()
    assert untied.lm_head.weight is not untied.wte.weight


# (LayerNorm arm) parameters untied / tied: the untied counts are the paper's size names.
PARAMETERS = {
    "70m": (70_950_912, 45_195_264),
    "160m": (163_109_376, 124_475_904),
    "410m": (406_382_592, 354_871_296),
    "1b": (1_013_878_784, 910_856_192),
}


@pytest.mark.parametrize("size", list(PARAMETERS))
def test_paper_sizes_compose_to_table_2(size: str) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"size={size}"])
    table2 = {"70m": (6, 512, 8, 1e-3), "160m": (12, 768, 12, 6e-4), "410m": (24, 1024, 16, 3e-4),
              "1b": (16, 2048, 8, 3e-4)}
    assert (cfg.size.n_layer, cfg.size.n_embd, cfg.size.n_head, cfg.size.lr) == table2[size]
    assert cfg.seq_len == 1024 and cfg.global_batch == 64 and cfg.tie_embeddings is False
    assert cfg.max_steps == (100_000 if size in ("70m", "160m") else 50_000)
    config = OmegaConf.to_object(cfg).gpt  # the validated schema's model
    assert (_count(config, tied=False), _count(config, tied=True)) == PARAMETERS[size]


def _count(config: GPTConfig, tied: bool) -> int:
    d, layers, vocab = config.n_embd, config.n_layer, config.padded_vocab_size
    per_block = 12 * d * d + 13 * d  # attention + MLP matrices and biases, two LayerNorms (gain + bias)
    return vocab * d * (1 if tied else 2) + config.block_size * d + layers * per_block + 2 * d


def test_parameter_count_formula_matches_the_module() -> None:
    config = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=128)
    assert GPT(config).num_parameters() == _count(config, tied=True)
    untied = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=128, tie_embeddings=False)
    assert GPT(untied).num_parameters() == _count(untied, tied=False)


def test_forward_loss_and_causality() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)).eval()
    idx = torch.randint(0, 50257, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 50304)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 50257
    # Changing the last token must not change any earlier position's logits.
    assert torch.allclose(model(changed)[:, :-1], logits[:, :-1], atol=1e-5)
    loss = model(idx, idx)
    assert abs(loss.item() - torch.log(torch.tensor(50304.0)).item()) < 0.5  # near-uniform at init


def test_unknown_norm_is_rejected_with_the_valid_choices() -> None:
    with pytest.raises(ValueError, match="layer, rms"):
        GPTConfig(norm="batch")


def test_lr_schedule_warmup_then_cosine_to_ten_percent() -> None:
    kwargs = {"warmup_steps": 10, "max_steps": 110, "min_lr_ratio": 0.1}
    assert warmup_cosine(0, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(9, **kwargs) == pytest.approx(1.0)
    assert warmup_cosine(60, **kwargs) == pytest.approx(0.55)
    assert warmup_cosine(110, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(500, **kwargs) == pytest.approx(0.1)


def test_step_rates_are_the_tokens_and_model_flops_of_the_steps_since_the_last_report_over_their_time() -> (
    None
):
    """perf/tokens_per_s and perf/mfu through Lightning's Throughput: nothing at a session's first report,
    then the global tokens of the steps since the previous report over their seconds, and per device their
    model FLOPs against the peak (2 devices, a declared peak standing in for a GPU's)."""
    module = LitGPT(TINY, OptimSchema(lr=1e-3, warmup_steps=1000), seed=0, max_steps=10, global_batch=4)
    peak = 1e9
    module.start_throughput(peak, world_size=2)
    assert module.step_rates(5, now=10.0) == {}
    rates = module.step_rates(6, now=10.5)
    tokens_per_s = module.tokens_per_step / 0.5  # 4 sequences x 8 tokens, over both devices
    assert rates["perf/tokens_per_s"] == pytest.approx(tokens_per_s)
    assert rates["perf/mfu"] == pytest.approx(module.model.flops_per_token(8) * tokens_per_s / 2 / peak)
    # Reports every 4 steps: the rates over the 4 steps since the previous report, not over one.
    rates = module.step_rates(10, now=12.5)
    assert rates["perf/tokens_per_s"] == pytest.approx(4 * module.tokens_per_step / 2.0)
    assert rates["perf/mfu"] == pytest.approx(
        module.model.flops_per_token(8) * rates["perf/tokens_per_s"] / 2 / peak
    )
    module.start_throughput(None, world_size=1)  # the CPU: no MFU
    module.step_rates(1, now=0.0)
    assert set(module.step_rates(2, now=1.0)) == {"perf/tokens_per_s"}


def test_weight_decay_only_on_matrices() -> None:
    module = LitGPT(TINY, OptimSchema(lr=1e-3, warmup_steps=1000), seed=0, max_steps=10, global_batch=2)
    optimizer = module.configure_optimizers()["optimizer"]
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert sum(p.numel() for g in (decayed, plain) for p in g["params"]) == module.model.num_parameters()


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_mixed_clips_the_gradients_before_fused_adamw(fused: bool) -> None:
    """The GPU's combination, on the CPU's fused AdamW: bf16-mixed, fused,
    clipping. Lightning refuses to clip before a fused step under any mixed
    precision (for fp16's scaler); bf16 has none, and the clip must act."""
    def one_step(clip: float | None) -> tuple[float, torch.optim.Optimizer]:
        module = LitGPT(TINY, OptimSchema(lr=1e-2, warmup_steps=0, weight_decay=0.0, fused=fused), seed=0,
                        max_steps=1, global_batch=2)
        before = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
        tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
        batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                                              batch_size=2)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision="bf16-mixed",
            max_steps=1,
            gradient_clip_val=clip,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, batches)
        after = torch.cat([p.detach().flatten() for p in module.parameters()])
        return (after - before).abs().sum().item(), trainer.optimizers[0]

    free, optimizer = one_step(None)
    clipped, _ = one_step(1e-12)
    assert optimizer.defaults["fused"] is fused
    # Adam's first step is about lr per coordinate whatever the gradient's scale, until the scale nears eps:
    # gradients clipped to a norm of 1e-12 move the weights by a ten-thousandth of that.
    assert clipped < 1e-2 * free, (clipped, free)


def test_fp16_with_a_grad_scaler_and_clipping_runs_adamw_unfused_with_one_warning(caplog) -> None:
    """16-mixed's scaler: a fused step unscales inside, so clipping could not
    come first (Lightning raises). Asked for anyway, AdamW runs unfused, says
    so in one line, and the step is taken (CPU's GradScaler stands in)."""
    module = LitGPT(TINY, OptimSchema(lr=1e-2, warmup_steps=0, fused=True), seed=0, max_steps=1,
                    global_batch=2)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    batches = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2
    )
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[fp16],
        max_steps=1,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level("WARNING", logger="models.lit"):
        trainer.fit(module, batches)
    assert trainer.global_step == 1 and trainer.optimizers[0].defaults["fused"] is False
    assert [r.getMessage() for r in caplog.records if r.name == "models.lit"] == [
        "optim.fused=true: not with 16-mixed and gradient clipping (the fused step unscales the "
        "gradients itself); "
        "AdamW runs unfused"
    ]


def test_weight_decay_groups_are_decided_by_name_not_by_shape_at_optimizer_time() -> None:
    """A sharding scheme that flattens parameters still gets matrices-only decay (FSDP2:
    tests/test_sharded.py)."""
    module = LitGPT(TINY, OptimSchema(lr=1e-3, warmup_steps=1000), seed=0, max_steps=10, global_batch=2)
    matrices = {id(p) for p in module.model.parameters() if p.dim() >= 2}
    for param in module.model.parameters():
        param.data = param.data.reshape(-1)
    decayed, plain = module.configure_optimizers()["optimizer"].param_groups
    assert {id(p) for p in decayed["params"]} == matrices
    assert not matrices & {id(p) for p in plain["params"]}


def test_divergence_names_the_first_non_finite_loss_and_refuses_non_finite_weights() -> None:
    """models.divergence: the first non-finite loss is kept on the device and named at the next check; the
    weights are checked before a checkpoint keeps them, the decision through Lightning's strategy."""
    watch = Divergence(lr=1e-3)
    assert watch.check(torch.tensor(2.5)) == [2.5]  # nothing noted yet: the values alone
    for step, loss in ((1, 3.0), (2, float("nan")), (3, float("inf"))):
        watch.note(torch.tensor(loss), step)
    with pytest.raises(NonFiniteError) as diverged:
        watch.check()
    assert diverged.value.step == 2 and str(diverged.value).startswith(
        "training diverged: the training loss is nan at step 2; the likely cause is the learning rate, "
        "optim.lr=0.001: lower it (e.g. optim.lr=0.0001)")
    strategy = SingleDeviceStrategy(torch.device("cpu"))
    finite = Divergence(lr=1e-3)
    finite.note(torch.tensor(1.0), 1)
    finite.check_weights([torch.ones(2)], strategy, 5, "kept")
    with pytest.raises(NonFiniteError, match=r"the parameters are not finite after step 5 \(stopped without "
                                             r"saving; kept\)"):
        finite.check_weights([torch.ones(2), torch.tensor([float("inf")])], strategy, 5, "kept")
