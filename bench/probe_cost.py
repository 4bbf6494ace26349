"""Cost of the probe next to a plain eval forward pass over the same tokens, and its peak memory.

Every probe variant is the pipeline the training probe and ``analyze.py`` run
(:func:`normgeo.measure.pipeline.measure_records`, records included); the baseline is the same model in eval
mode under no_grad with no hooks. Two token counts:

- ``--tokens`` (a probe larger than the intervention's budget, as the paper's 1M-token probes are): the angle
  probe alone (K = 0; K = 64 + energy, as trained), the **default probe**: K = 64 + energy + the centering
  intervention's default scope (all norms at once) on the first ``probe.intervention_tokens``, and the same
  with the per-block breakdown (all + one block at a time);
- ``--budget-tokens`` (the whole probe intervened on): the all-norms scope, and the breakdown resumed
  mid-stack (as it runs) and re-run from the embeddings (``resume_mid_stack=False``), so that the scopes'
  own cost reads in plain forwards.

Variants are interleaved within each repeat so that machine noise hits them alike; the load average is
printed with the numbers. Peak memory is measured in a fresh process per token count (ru_maxrss, the default
probe), to show it does not grow with N.

    python bench/probe_cost.py                       # 70m, 32768 + 4096 tokens, memory at 4096 and 16384
    python bench/probe_cost.py --size 160m --tokens 65536 --memory-tokens 8192 65536
    python bench/probe_cost.py --device cuda --batch-size 8 --memory-tokens      # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from hydra import compose, initialize_config_dir
from torch.autograd.profiler_util import FunctionEvent

from models.gpt import GPT
from models.hardware import missing_cuda
from normgeo.config.checks import check_config
from normgeo.config.compose import CONF_DIR
from normgeo.measure.intervention import DEFAULT_INTERVENTION_TOKENS, DEFAULT_SCOPES
from normgeo.measure.pipeline import PROBE_SCOPE, measure_records, tiktoken_separator
from normgeo.measure.probe import make_references
from normgeo.measure.probe_config import ProbeConfig
from normgeo.runs.build import make_module

BREAKDOWN = ("all", "layers")  # the per-block breakdown a user asks for (probe.intervention=[all,layers])
# The aten ops that hand a tensor's value (or its size) to the host: on a GPU each waits for every queued
# kernel. On the CPU they cost nothing, but the profiler records them: counted there, they are the
# syncs the same code makes on a GPU (a copy of a GPU tensor to the CPU is one too, invisible on the CPU).
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
})
# Ops whose CPU kernel reads a scalar of its own (fused AdamW's step count) that its CUDA kernel reads on the
# device: the reads inside them are the CPU's, not a wait a GPU makes (the harness steps a fused AdamW there).
CPU_KERNEL_READS = frozenset({"aten::_fused_adamw_", "aten::_fused_adam_"})


def op_counts(events: list[FunctionEvent], scope: str | None = PROBE_SCOPE) -> dict[str, int]:
    """Among profiled CPU ``events`` (``prof.events()``), inside the ``scope`` label (run_probe's batches;
    None: all): ``syncs``, the host-sync ops of :data:`HOST_SYNC_OPS` not inside another (``item`` calls
    ``_local_scalar_dense``: one sync) nor inside an op of :data:`CPU_KERNEL_READS`, ``aten`` every aten op,
    ``aten_outermost`` those called from Python (not from another aten op: about one kernel launch each on a
    GPU), and each sync op's own count."""
    # Per event, from its parent's: (inside the scope, inside an aten op, inside a host-sync op or a CPU
    # kernel's own read).
    flags: dict[int, tuple[bool, bool, bool]] = {}

    def of(event: FunctionEvent | None) -> tuple[bool, bool, bool]:
        if event is None:
            return scope is None, False, False
        if id(event) not in flags:
            inside, aten, sync = of(event.cpu_parent)
            name = event.name
            flags[id(event)] = (inside or name == scope, aten or name.startswith("aten::"),
                                sync or name in HOST_SYNC_OPS or name in CPU_KERNEL_READS)
        return flags[id(event)]

    counts = {"syncs": 0, "aten": 0, "aten_outermost": 0}
    for event in events:
        if event.is_async or not event.name.startswith("aten::"):
            continue
        inside, below_aten, below_sync = of(event.cpu_parent)
        if not inside:
            continue
        counts["aten"] += 1
        counts["aten_outermost"] += not below_aten
        if event.name in HOST_SYNC_OPS and not below_sync:
            counts["syncs"] += 1
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def build(size: str) -> GPT:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = check_config("train", compose("train", overrides=[f"size={size}"]))
    return make_module(cfg, seed=0).model.eval()  # as train.py builds it: norm included


def token_ids(count: int) -> torch.Tensor:
    return torch.randint(0, 50257, (count,), generator=torch.Generator().manual_seed(0))


def plain_forward(model: GPT, ids: torch.Tensor, batch_size: int) -> None:
    device = next(model.parameters()).device  # the probe moves its batches there too
    with torch.no_grad():
        for batch in ids.view(-1, model.config.block_size).split(batch_size):
            model(batch.to(device))


def probe(
    model: GPT,
    ids: torch.Tensor,
    batch_size: int,
    *,
    null: int = 64,
    energy_and_rows: bool = True,
    scopes: tuple[str, ...] = (),
    budget: int = DEFAULT_INTERVENTION_TOKENS,
    resume: bool = True,
    mean_sources: bool = True,
) -> None:
    """The pipeline's probe of ``ids``: angles with ``null`` null directions (and the energy, ellipsoid, mean
    sources and every record row), plus the intervention's ``scopes`` on the first ``budget`` tokens; the
    document starts found as the training probe finds them, after GPT-2's end-of-text."""
    config = ProbeConfig(tokens=len(ids), null_directions=null, intervention=list(scopes),
                         intervention_tokens=budget, mean_sources=mean_sources)
    measure_records(
        model,
        ids,
        model.config.block_size,
        make_references(model.config.n_embd, config.seed, null),
        config,
        batch_size=batch_size,
        model_name="bench",
        step=0,
        tokens_per_step=None,
        with_null=energy_and_rows,
        resume_mid_stack=resume,
        separator=tiktoken_separator(),
    )


def peak_rss_child(size: str, tokens: int, batch_size: int, device: torch.device) -> None:
    model = build(size).to(device)
    probe(model, token_ids(tokens), batch_size, scopes=DEFAULT_SCOPES)
    peak_gpu = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    print(
        json.dumps(
            {
                "tokens": tokens,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "peak_gpu_mib": peak_gpu,
            }
        )
    )


def timed(variants: dict, model: GPT, batch_size: int, repeats: int) -> dict[str, list[float]]:
    cuda = next(model.parameters()).device.type == "cuda"
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved, so machine noise hits every variant alike
        for name, fn in variants.items():
            if cuda:  # queued kernels are counted in the variant that queued them
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn(model, batch_size)
            if cuda:
                torch.cuda.synchronize()
            timings[name].append(time.perf_counter() - start)
    return timings


def report(title: str, timings: dict[str, list[float]]) -> dict[str, float]:
    print(title)
    for name, values in timings.items():
        print(f"  {name:52s} best {min(values):7.3f} s  median {sorted(values)[len(values) // 2]:7.3f} s  "
              f"all {', '.join(f'{v:.3f}' for v in values)}")
    best = {name: min(values) for name, values in timings.items()}
    for name in best:
        if name != "plain forward":
            print(f"  {name} / plain forward (best): {best[name] / best['plain forward']:.3f}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="70m")
    parser.add_argument(
        "--tokens", type=int, default=32768, help="probe tokens of the default-probe comparison"
    )
    parser.add_argument("--budget-tokens", type=int, default=4096,
                        help="probe tokens of the comparison that intervenes on all of them")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-tokens", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--device", default="cpu", help="where the model and the probe run: cpu or cuda")
    parser.add_argument("--mean-sources-cost", action="store_true",
                        help="only the default probe with and without mean_sources.jsonl, interleaved")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if reason := missing_cuda("--device", args.device, "--device cpu"):
        print(f"bench/probe_cost.py: {reason}", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(args.device)
    if args.child:
        return peak_rss_child(args.size, args.tokens, args.batch_size, device)

    model = build(args.size).to(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"size={args.size} device={where} batch={args.batch_size} threads={torch.get_num_threads()} "
          f"repeats={args.repeats} load average before={os.getloadavg()[0]:.2f} "
          f"intervention budget={DEFAULT_INTERVENTION_TOKENS} scopes={','.join(DEFAULT_SCOPES)}")
    probe(model, token_ids(model.config.block_size), 1)  # warm-up: allocator, kernels
    large, small = token_ids(args.tokens), token_ids(args.budget_tokens)
    default = f"default probe (+intervention on the first {min(DEFAULT_INTERVENTION_TOKENS, args.tokens)})"
    if args.mean_sources_cost:
        best = report(f"probe tokens={args.tokens}", timed({
            "plain forward": lambda m, b: plain_forward(m, large, b),
            f"{default} without mean sources": lambda m, b: probe(m, large, b, scopes=DEFAULT_SCOPES,
                                                                 mean_sources=False),
            default: lambda m, b: probe(m, large, b, scopes=DEFAULT_SCOPES),
        }, model, args.batch_size, args.repeats))
        print(f"MEAN SOURCES COST (default probe with / without, best): "
              f"{best[default] / best[f'{default} without mean sources']:.3f}")
        return None
    best = report(f"probe tokens={args.tokens}", timed({
        "plain forward": lambda m, b: plain_forward(m, large, b),
        "angle probe K=0": lambda m, b: probe(m, large, b, null=0, energy_and_rows=False),
        "angle probe K=64 +energy": lambda m, b: probe(m, large, b),
        default: lambda m, b: probe(m, large, b, scopes=DEFAULT_SCOPES),
        f"{default} +layers": lambda m, b: probe(m, large, b, scopes=BREAKDOWN),
    }, model, args.batch_size, args.repeats))
    print(
        f"DEFAULT PROBE / PLAIN FORWARD at {args.tokens} probe tokens: "
        f"{best[default] / best['plain forward']:.3f}"
    )
    every = report(f"probe tokens={args.budget_tokens}, every one intervened on", timed({
        "plain forward": lambda m, b: plain_forward(m, small, b),
        "angle probe K=64 +energy": lambda m, b: probe(m, small, b),
        "+intervention all": lambda m, b: probe(m, small, b, scopes=DEFAULT_SCOPES),
        "+intervention all,layers resumed mid-stack": lambda m, b: probe(m, small, b, scopes=BREAKDOWN),
        "+intervention all,layers re-run from the embeddings": lambda m, b: probe(
            m, small, b, scopes=BREAKDOWN, resume=False),
    }, model, args.batch_size, args.repeats))
    angles = every["angle probe K=64 +energy"]
    for name, scopes in (("+intervention all", 1),
                         # all, blocks, final
                         ("+intervention all,layers resumed mid-stack", model.config.n_layer + 2),
                         ("+intervention all,layers re-run from the embeddings", model.config.n_layer + 2)):
        extra = (every[name] - angles) / every["plain forward"]
        print(
            f"  {name}: the {scopes} scope(s) cost {extra:.2f} plain forwards ({extra / scopes:.2f} "
            "per scope)"
        )
    print(f"load average after={os.getloadavg()[0]:.2f}")
    for tokens in args.memory_tokens:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--size",
                args.size,
                "--tokens",
                str(tokens),
                "--batch-size",
                str(args.batch_size),
                "--device",
                args.device,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        gpu = (
            f", peak GPU memory {result['peak_gpu_mib']:.0f} MiB"
            if result["peak_gpu_mib"] is not None
            else ""
        )
        print(
            f"peak RSS of the default probe with probe.tokens={result['tokens']:>7d}: "
            f"{result['peak_rss_mib']:.0f} MiB"
            f"{gpu}"
        )


if __name__ == "__main__":
    main()
