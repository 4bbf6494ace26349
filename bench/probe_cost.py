"""Cost of the probe next to a plain eval forward pass over the same tokens, and its peak memory.

Every variant is the pipeline the training probe and ``analyze.py`` run (``measure_records``, records
included); the baseline is the same model in eval mode under no_grad with no hooks. Over ``--tokens`` (more
than the intervention's budget): the angle probe alone (K = 0; K = 64 + energy), the **default probe** (K = 64
+ energy + the intervention's default scope on the first ``probe.intervention_tokens``), and it with the
per-block breakdown; over ``--budget-tokens`` (all intervened on): the all-norms scope, and the breakdown
resumed mid-stack and re-run from the embeddings, so that the scopes' own cost reads in plain forwards.
Variants are interleaved within each repeat; the load average is printed. Peak memory (ru_maxrss, the default
probe) is measured in a fresh process per token count, to show it does not grow with N.

``--table``: the variants of issue 73 (:data:`TABLE`) over ``--tokens``, every token intervened on, each
against the plain forward over the same tokens, medians of the interleaved repeats; ``--analyze``: the same
for analyze.py's default probe alone (:data:`ANALYZE`). ``--model`` takes an
``analyze.py`` preset (conf/analyze/model/) for a GPT size: the probe is then analyze.py's (the model's own
forward, the LM head only for the intervention, seeded random token ids, the model's separator every 97).

    python bench/probe_cost.py                       # 70m, 32768 + 4096 tokens, memory at 4096 and 16384
    python bench/probe_cost.py --size 160m --tokens 65536 --memory-tokens 8192 65536
    python bench/probe_cost.py --device cuda --batch-size 8 --memory-tokens      # on a GPU
    python bench/probe_cost.py --table --model smollm2-135m --tokens 8192 --batch-size 8 --repeats 3
    python bench/probe_cost.py --analyze --model smollm2-135m --tokens 100000 --batch-size 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from hydra import compose, initialize_config_dir
from torch import nn
from torch.autograd.profiler_util import FunctionEvent

from models.hardware import missing_cuda
from models.pretrained import hf_forward, load_model, max_positions
from normgeo.config.checks import check_config
from normgeo.config.compose import ANALYZE_CONF_DIR, CONF_DIR
from normgeo.measure.intervention import DEFAULT_INTERVENTION_TOKENS, DEFAULT_SCOPES
from normgeo.measure.norm_sites import NormSite, find_norm_sites
from normgeo.measure.pipeline import PROBE_SCOPE, measure_records, tiktoken_separator, windows
from normgeo.measure.probe import make_references, residual_norms
from normgeo.measure.probe_config import ProbeConfig
from normgeo.runs.build import make_module

BREAKDOWN = ("all", "layers")  # the per-block breakdown a user asks for (probe.intervention=[all,layers])
# The aten ops that hand a tensor's value (or its size) to the host: on a GPU each waits for every queued
# kernel. The CPU's profiler records them too: counted there, they are the syncs the same code makes on a GPU
# (a copy of a GPU tensor to the CPU is one too, invisible on the CPU).
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
})
# Ops whose CPU kernel reads a scalar of its own (fused AdamW's step count) that its CUDA kernel reads on the
# device: the reads inside them are the CPU's, not a wait a GPU makes (the harness steps a fused AdamW there).
CPU_KERNEL_READS = frozenset({"aten::_fused_adamw_", "aten::_fused_adam_"})


def op_counts(events: list[FunctionEvent], scope: str | None = PROBE_SCOPE) -> dict[str, int]:
    """Among profiled CPU ``events`` (``prof.events()``) inside the ``scope`` label (run_probe's batches;
    None: all): ``syncs``, the ops of :data:`HOST_SYNC_OPS` not inside another (``item`` calls
    ``_local_scalar_dense``: one sync) nor inside one of :data:`CPU_KERNEL_READS`; ``aten``, every aten op;
    ``aten_outermost``, those called from Python (about one kernel launch each on a GPU); each sync op's
    count."""
    # Per event, from its parent's: inside the scope, an aten op, a sync op or a CPU kernel's own read.
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


class Subject(NamedTuple):
    """The model a probe is timed on, a GPT of ours or an analyze.py preset: ``model`` (with the LM head where
    the intervention needs one), ``forward`` on token ids (None: ``model(batch)``), and ``base``, the plain
    forward compared with (and that the probe without the intervention measures: analyze.py loads no head)."""

    name: str
    model: nn.Module
    forward: Callable[[torch.Tensor], object] | None
    base: Callable[[torch.Tensor], object]
    seq_len: int
    dim: int
    norms: list[NormSite]
    separator: int | None
    vocab: int


def build(size: str) -> nn.Module:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = check_config("train", compose("train", overrides=[f"size={size}"]))
    return make_module(cfg, seed=0).model.eval()  # as train.py builds it: norm included


def gpt_subject(size: str, device: torch.device) -> Subject:
    model = build(size).to(device)
    return Subject(name=size, model=model, forward=None, base=model, seq_len=model.config.block_size,
                   dim=model.config.n_embd, norms=find_norm_sites(model), separator=tiktoken_separator(),
                   vocab=model.config.vocab_size)


def preset_subject(preset: str, device: torch.device) -> Subject:
    """An analyze.py preset (``model=<preset>``), loaded as analyze.py loads it, with its LM head."""
    with initialize_config_dir(config_dir=ANALYZE_CONF_DIR, version_base="1.3"):
        cfg = compose("analyze", overrides=[f"model={preset}"])
    loaded = load_model(cfg.model, lm_head=True)
    model = loaded.model.to(device).eval()
    base = getattr(model, "base_model", model)  # analyze.py's model without the intervention: no LM head
    limit = max_positions(model)
    norms = find_norm_sites(model)
    return Subject(name=cfg.model.name, model=model, forward=loaded.forward,
                   base=hf_forward(base) if base is not model else loaded.forward,
                   seq_len=min(cfg.model.seq_len, limit) if limit else cfg.model.seq_len,
                   dim=residual_norms(norms)[0].dim, norms=norms, separator=loaded.separator,
                   vocab=model.config.vocab_size)


def token_ids(count: int, subject: Subject | None = None) -> torch.Tensor:
    """Seeded random token ids; for a preset, below its vocabulary with its separator every 97 tokens."""
    if subject is None or subject.forward is None:
        return torch.randint(0, 50257, (count,), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, subject.vocab, (count,), generator=torch.Generator().manual_seed(0))
    if subject.separator is not None:
        ids[96::97] = subject.separator
    return ids


def plain_forward(subject: Subject, ids: torch.Tensor, batch_size: int) -> None:
    device = next(subject.model.parameters()).device  # the probe moves its batches there too
    with torch.no_grad():
        for part in windows(ids, subject.seq_len):  # the probe's windows: a shorter last one too
            for batch in part.split(batch_size):
                subject.base(batch.to(device))


def probe(
    subject: Subject,
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
    sources and every record row), plus the intervention's ``scopes`` on the first ``budget`` tokens."""
    config = ProbeConfig(tokens=len(ids), null_directions=null, intervention=list(scopes),
                         intervention_tokens=budget, mean_sources=mean_sources)
    references = make_references(subject.dim, config.seed, null)
    measure_records(subject.model, ids, subject.seq_len, references, config, batch_size=batch_size,
                    model_name="bench", step=0, tokens_per_step=None, with_null=energy_and_rows,
                    norms=subject.norms, forward=subject.forward, headless=subject.base,
                    resume_mid_stack=resume, separator=subject.separator)


def peak_rss_child(subject: Subject, tokens: int, batch_size: int, device: torch.device) -> None:
    probe(subject, token_ids(tokens, subject), batch_size, scopes=DEFAULT_SCOPES)
    peak_gpu = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": tokens, "peak_rss_mib": peak_rss, "peak_gpu_mib": peak_gpu}))


def timed(variants: dict, subject: Subject, batch_size: int, repeats: int) -> dict[str, list[float]]:
    # Queued kernels are counted in the variant that queued them.
    cuda = next(subject.model.parameters()).device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else lambda: None
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved, so machine noise hits every variant alike
        for name, fn in variants.items():
            synchronize()
            start = time.perf_counter()
            fn(subject, batch_size)
            synchronize()
            timings[name].append(time.perf_counter() - start)
    return timings


def report(title: str, timings: dict[str, list[float]]) -> dict[str, float]:
    print(title)
    for name, values in timings.items():
        print(f"  {name:52s} best {min(values):7.3f} s  median {statistics.median(values):7.3f} s  "
              f"all {', '.join(f'{v:.3f}' for v in values)}")
    best = {name: min(values) for name, values in timings.items()}
    for name in best:
        if name != "plain forward":
            print(f"  {name} / plain forward (best): {best[name] / best['plain forward']:.3f}")
    return best


TABLE = (  # issue 73's variants: (name, probe options)
    ("angles only (K=0, no intervention, no mean sources)",
     {"null": 0, "energy_and_rows": False, "mean_sources": False}),
    ("+64 null directions, energy, mean sources (no intervention)", {}),
    ("default (+the intervention on every token)", {"scopes": DEFAULT_SCOPES, "budget": None}),
    ("default without mean_sources.jsonl", {"scopes": DEFAULT_SCOPES, "budget": None, "mean_sources": False}),
)


# analyze.py's own probe: the default, the intervention on its first probe.intervention_tokens only.
ANALYZE = ((f"analyze.py's default (+the intervention on the first {DEFAULT_INTERVENTION_TOKENS:,} tokens)",
            {"scopes": DEFAULT_SCOPES}),)


def table(subject: Subject, tokens: int, batch_size: int, repeats: int,
          variants: tuple[tuple[str, dict], ...] = TABLE) -> None:
    """The ``variants`` against the plain forward, interleaved: a markdown table of medians."""
    ids = token_ids(tokens, subject)

    def variant(options: dict) -> Callable[[Subject, int], None]:
        return lambda s, b: probe(s, ids, b, **options)

    before = os.getloadavg()
    timings = timed({"plain forward": lambda s, b: plain_forward(s, ids, b),
                     **{name: variant(options) for name, options in variants}}, subject, batch_size, repeats)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    print(f"{subject.name}: {tokens} probe tokens, batches of {batch_size} x {subject.seq_len}, {repeats} "
          f"interleaved repeat(s), load average before {before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print("| variant | probe (median) | / plain forward | all |\n| --- | --- | --- | --- |")
    for name, values in timings.items():
        print(f"| {name} | {medians[name]:.2f} s | {medians[name] / medians['plain forward']:.2f} | "
              f"{', '.join(f'{v:.2f}' for v in values)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="70m")
    parser.add_argument("--model", default=None,
                        help="an analyze.py preset (conf/analyze/model/: smollm2-135m, ...) for --size")
    parser.add_argument("--tokens", type=int, default=32768,
                        help="probe tokens of the default-probe comparison")
    parser.add_argument("--budget-tokens", type=int, default=4096,
                        help="probe tokens of the comparison that intervenes on all of them")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-tokens", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--device", default="cpu", help="where the model and the probe run: cpu or cuda")
    parser.add_argument("--mean-sources-cost", action="store_true",
                        help="only the default probe with and without mean_sources.jsonl, interleaved")
    parser.add_argument("--table", action="store_true",
                        help="only issue 73's variants over --tokens, every token intervened on, medians")
    parser.add_argument("--analyze", action="store_true",
                        help="only analyze.py's default probe over --tokens against the plain forward")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if reason := missing_cuda("--device", args.device, "--device cpu"):
        print(f"bench/probe_cost.py: {reason}", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(args.device)
    subject = preset_subject(args.model, device) if args.model else gpt_subject(args.size, device)
    if args.child:
        return peak_rss_child(subject, args.tokens, args.batch_size, device)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model={subject.name} device={where} batch={args.batch_size} threads={torch.get_num_threads()} "
          f"repeats={args.repeats} load average before={os.getloadavg()[0]:.2f} "
          f"intervention budget={DEFAULT_INTERVENTION_TOKENS} scopes={','.join(DEFAULT_SCOPES)}")
    probe(subject, token_ids(subject.seq_len, subject), 1)  # warm-up: allocator, kernels
    if args.table or args.analyze:
        return table(subject, args.tokens, args.batch_size, args.repeats, TABLE if args.table else ANALYZE)
    large, small = token_ids(args.tokens, subject), token_ids(args.budget_tokens, subject)
    default = f"default probe (+intervention on the first {min(DEFAULT_INTERVENTION_TOKENS, args.tokens)})"
    if args.mean_sources_cost:
        best = report(f"probe tokens={args.tokens}", timed({
            "plain forward": lambda m, b: plain_forward(m, large, b),
            f"{default} without mean sources": lambda m, b: probe(m, large, b, scopes=DEFAULT_SCOPES,
                                                                 mean_sources=False),
            default: lambda m, b: probe(m, large, b, scopes=DEFAULT_SCOPES),
        }, subject, args.batch_size, args.repeats))
        print(f"MEAN SOURCES COST (default probe with / without, best): "
              f"{best[default] / best[f'{default} without mean sources']:.3f}")
        return None
    best = report(f"probe tokens={args.tokens}", timed({
        "plain forward": lambda m, b: plain_forward(m, large, b),
        "angle probe K=0": lambda m, b: probe(m, large, b, null=0, energy_and_rows=False),
        "angle probe K=64 +energy": lambda m, b: probe(m, large, b),
        default: lambda m, b: probe(m, large, b, scopes=DEFAULT_SCOPES),
        f"{default} +layers": lambda m, b: probe(m, large, b, scopes=BREAKDOWN),
    }, subject, args.batch_size, args.repeats))
    print(f"DEFAULT PROBE / PLAIN FORWARD at {args.tokens} probe tokens: "
          f"{best[default] / best['plain forward']:.3f}")
    every = report(f"probe tokens={args.budget_tokens}, every one intervened on", timed({
        "plain forward": lambda m, b: plain_forward(m, small, b),
        "angle probe K=64 +energy": lambda m, b: probe(m, small, b),
        "+intervention all": lambda m, b: probe(m, small, b, scopes=DEFAULT_SCOPES),
        "+intervention all,layers resumed mid-stack": lambda m, b: probe(m, small, b, scopes=BREAKDOWN),
        "+intervention all,layers re-run from the embeddings": lambda m, b: probe(
            m, small, b, scopes=BREAKDOWN, resume=False),
    }, subject, args.batch_size, args.repeats))
    angles = every["angle probe K=64 +energy"]
    blocks = len({norm.layer for norm in residual_norms(subject.norms) if isinstance(norm.layer, int)})
    for name, scopes in (("+intervention all", 1),
                         # all, blocks, final
                         ("+intervention all,layers resumed mid-stack", blocks + 2),
                         ("+intervention all,layers re-run from the embeddings", blocks + 2)):
        extra = (every[name] - angles) / every["plain forward"]
        print(f"  {name}: the {scopes} scope(s) cost {extra:.2f} plain forwards ({extra / scopes:.2f} "
              "per scope)")
    print(f"load average after={os.getloadavg()[0]:.2f}")
    model = ["--model", args.model] if args.model else ["--size", args.size]
    for tokens in args.memory_tokens:
        child = [sys.executable, __file__, "--child", *model, "--tokens", str(tokens), "--batch-size",
                 str(args.batch_size), "--device", args.device]
        out = subprocess.run(child, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        gpu = "" if result["peak_gpu_mib"] is None else f", peak GPU memory {result['peak_gpu_mib']:.0f} MiB"
        print(f"peak RSS of the default probe with probe.tokens={result['tokens']:>7d}: "
              f"{result['peak_rss_mib']:.0f} MiB{gpu}")


if __name__ == "__main__":
    main()
