"""Cost of the angle probe next to a plain eval forward pass over the same tokens, and its peak memory.

The probe runs the model with forward hooks on every norm and streams the angles into statistics;
the baseline is the same model in eval mode under no_grad with no hooks. The probe runs twice: with
K = 0 null directions (1, rand_a, rand_b only) and with K = 64 (``--null``), per-sequence sums included;
the ratio K=64 / K=0 is the cost of the null distribution; "+energy" adds the energy along 1 and
sqrt(d)/||x|| at every norm input (normgeo/measure/energy.py), as the training probe runs it; "+intervention"
adds the centering intervention after each forward (normgeo/measure/intervention.py): the all-norms scope
alone (one extra forward) and the training probe's default, all + one block at a time (L + 2 extra
forwards). Peak memory is measured in a fresh process per token count (ru_maxrss, K = 64), to show it does
not grow with N.

    python bench/probe_cost.py                       # 70m model, 4096 tokens, memory at 4096 and 16384
    python bench/probe_cost.py --size 160m --tokens 8192 --memory-tokens 8192 65536
    python bench/probe_cost.py --device cuda --tokens 16384 --batch-size 8 --memory-tokens   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.gpt import GPT  # noqa: E402
from models.hardware import missing_cuda  # noqa: E402
from normgeo.measure.energy import EnergyStatistics  # noqa: E402
from normgeo.measure.intervention import InterventionProbe, intervention_scopes  # noqa: E402
from normgeo.measure.norm_sites import find_norm_sites  # noqa: E402
from normgeo.measure.probe import make_references, residual_norms, run_probe  # noqa: E402
from normgeo.runs.config import CONF_DIR  # noqa: E402


def build(size: str) -> GPT:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"size={size}"])
    return instantiate(cfg.model, seed=0).model.eval()  # conf/train/train.yaml's model node: norm included


def token_sequences(count: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, 50257, (count // seq_len, seq_len), generator=torch.Generator().manual_seed(0))


def plain_forward(model: GPT, sequences: torch.Tensor, batch_size: int) -> None:
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in sequences.split(batch_size):
            model(batch.to(device))


def probe(model: GPT, sequences: torch.Tensor, batch_size: int, null: int = 0, energy: bool = False,
          intervention: Sequence[str] = ()) -> None:
    """``energy``: also the energy along 1 and sqrt(d)/||x|| at every norm input, as the training probe does;
    ``intervention``: the centering intervention's scopes, run after each forward."""
    device = next(model.parameters()).device  # the statistics stay where the model runs, as in training
    norms = residual_norms(find_norm_sites(model))
    scopes = intervention_scopes(norms, intervention) if intervention else []
    changes = InterventionProbe(norms, scopes, len(sequences), device=device) if scopes else None
    with changes or contextlib.nullcontext():
        run_probe(model, sequences, make_references(model.config.n_embd, null_directions=null),
                  batch_size=batch_size, norms=norms,
                  energy=EnergyStatistics(len(norms), device=device) if energy else None,
                  on_batch=changes.observe if changes is not None else None)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of ``fn()``; on CUDA synchronized before and after, so that queued kernels are counted."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def peak_rss_child(size: str, tokens: int, batch_size: int, null: int, device: torch.device) -> None:
    model = build(size).to(device)
    probe(model, token_sequences(tokens, model.config.block_size), batch_size, null)
    peak_gpu = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    print(json.dumps({"tokens": tokens, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_gpu_mib": peak_gpu}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="70m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-tokens", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--null", type=int, default=64, help="null directions K of the second probe variant")
    parser.add_argument("--no-layers", action="store_true",
                        help="leave out the per-block intervention variant (L + 2 extra forwards)")
    parser.add_argument("--device", default="cpu", help="where the model and the probe run: cpu or cuda")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if reason := missing_cuda("--device", args.device, "--device cpu"):
        print(f"bench/probe_cost.py: {reason}", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(args.device)
    if args.child:
        return peak_rss_child(args.size, args.tokens, args.batch_size, args.null, device)

    model = build(args.size).to(device)
    sequences = token_sequences(args.tokens, model.config.block_size)
    null_name = f"probe K={args.null}"
    energy_name = f"{null_name} +energy"  # what the training probe runs
    variants = {
        "plain forward": plain_forward,
        "probe K=0": lambda m, s, b: probe(m, s, b, 0),
        null_name: lambda m, s, b: probe(m, s, b, args.null),
        energy_name: lambda m, s, b: probe(m, s, b, args.null, energy=True),
        f"{energy_name} +intervention all": lambda m, s, b: probe(m, s, b, args.null, energy=True,
                                                                  intervention=("all",)),
    }
    if not args.no_layers:
        variants[f"{energy_name} +intervention all,layers"] = lambda m, s, b: probe(
            m, s, b, args.null, energy=True, intervention=("all", "layers"))
    timings: dict[str, list[float]] = {name: [] for name in variants}
    probe(model, sequences[:1], 1, args.null)  # warm-up: allocator, kernels
    for _ in range(args.repeats):  # interleaved, so machine noise hits every variant alike
        for name, fn in variants.items():
            timings[name].append(timed(partial(fn, model, sequences, args.batch_size), device))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"threads={torch.get_num_threads()}"
    print(f"size={args.size} tokens={sequences.numel()} batch={args.batch_size} device={device} {where}")
    for name, values in timings.items():
        print(f"{name:42s} best {min(values):7.3f} s  median {sorted(values)[len(values) // 2]:7.3f} s  "
              f"all {', '.join(f'{v:.3f}' for v in values)}")
    best = {name: min(values) for name, values in timings.items()}
    print(f"probe K=0 / plain forward (best): {best['probe K=0'] / best['plain forward']:.3f}")
    print(f"{null_name} / plain forward (best): {best[null_name] / best['plain forward']:.3f}")
    print(f"{null_name} / probe K=0 (best): {best[null_name] / best['probe K=0']:.3f}")
    print(f"{energy_name} / plain forward (best): {best[energy_name] / best['plain forward']:.3f}")
    print(f"{energy_name} / {null_name} (best): {best[energy_name] / best[null_name]:.3f}")
    for scopes in ("all", "all,layers"):
        name = f"{energy_name} +intervention {scopes}"
        if name in best:
            print(f"{name} / plain forward (best): {best[name] / best['plain forward']:.3f}")
            share = (best[name] - best[energy_name]) / best[name]
            print(f"intervention {scopes}: share of the probe {share:.1%}, "
                  f"{(best[name] - best[energy_name]) / best['plain forward']:.2f} plain forwards")
    for tokens in args.memory_tokens:
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--size", args.size, "--tokens", str(tokens),
             "--batch-size", str(args.batch_size), "--null", str(args.null), "--device", args.device],
            capture_output=True, text=True, check=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        gpu = f", peak GPU memory {result['peak_gpu_mib']:.0f} MiB" if result["peak_gpu_mib"] is not None else ""
        print(f"peak RSS with probe.tokens={result['tokens']:>7d} (K={args.null}): {result['peak_rss_mib']:.0f} MiB{gpu}")


if __name__ == "__main__":
    main()
