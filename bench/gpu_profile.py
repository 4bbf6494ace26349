"""Where the time goes in the two GPU paths that `bench/gpu_check.py` found slow: the probe against a plain
forward, and a `norm.impl=compiled` norm's forward + backward against the stock module.

`torch.profiler` over one warmed-up call of each: the top operators by self device and CPU time, the
host-device synchronizations (``probe_cost.HOST_SYNC_OPS``, which the CPU's profile counts as a GPU would wait
for them) and the wall time against the summed kernel time: far above it, the GPU waits on the host.

    python bench/gpu_profile.py --out docs/gpu_profile.md      # a GPU: 70m probe, 32768 tokens; norms at 2048
    python bench/gpu_profile.py --device cpu --size tiny --tokens 1024 --dim 256           # the CPU, printed
    python bench/gpu_profile.py --device cpu --size 70m --tokens 8192 --batch-size 4 --probe-only
        # the probe's ops on the CPU: the host syncs it would make on a GPU, and its aten ops
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchlib import refused, script_parser, synchronize, utc_stamp
from norm_cost import EPS, forward_backward
from probe_cost import gpt_subject, op_counts, plain_forward, probe, token_ids
from torch.profiler import ProfilerActivity, profile

from models.hardware import missing_cuda
from models.norms import make_norm
from normgeo.measure.geometry import gpu_code_path

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
               "aten::item", "aten::_local_scalar_dense")


def sync_summary(counts: dict[str, int]) -> str:
    """``12 (aten::nonzero ×8, aten::item ×4)`` from :func:`probe_cost.op_counts`' counts."""
    named = [f"{k} ×{v}" for k, v in sorted(counts.items()) if k.startswith("aten::")]
    return f"{counts['syncs']}" + (f" ({', '.join(named)})" if named else "")


def profiled(name: str, fn: Callable[[], object], device: torch.device, rows: int,
             probe_scope: bool = False) -> str:
    """One warm-up call, then one profiled call: wall time, device time, the top operators, the syncs.
    ``probe_scope``: the call is a probe; its ops inside ``run_probe`` (the batches) are counted apart."""
    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # On the CPU too the GPU's code path: the host syncs counted are those a GPU would wait for.
    with gpu_code_path(), profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key == "cudaLaunchKernel")
    syncs = {e.key: e.count for e in events if e.key in SYNC_EVENTS}
    every = op_counts(prof.events(), scope=None)
    ops = [f"- aten ops: {every['aten']} ({every['aten_outermost']} called from Python); host-sync aten ops "
           f"(a wait for the GPU each, there): {sync_summary(every)}"]
    if probe_scope:
        batches = op_counts(prof.events())
        ops.append(f"- in the probe's batches (run_probe, without the records): aten ops {batches['aten']} "
                   f"({batches['aten_outermost']} called from Python); host-sync aten ops: "
                   f"{sync_summary(batches)}")
    copies = ", ".join(f"{k} ×{v}" for k, v in sorted(syncs.items())) or "none"
    lines = [f"## {name}", "",
             f"- wall {wall * 1e3:.1f} ms (profiled); kernels {device_us / 1e3:.1f} ms on the device, "
             f"{kernels} of them ({launches} launches)",
             f"- host-device syncs and copies: {copies}", *ops]
    tables = [("self device time", "self_cuda_time_total")] if device.type == "cuda" else []
    for title, key in [*tables, ("self CPU time", "self_cpu_time_total")]:
        table = events.table(sort_by=key, row_limit=rows, max_name_column_width=60)
        lines += ["", f"By {title}:", "", "```", table, "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="70m")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048, help="the norms' width")
    parser.add_argument("--norm-tokens", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=15, help="operators listed per table")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the page there (markdown) as well as print it")
    parser.add_argument("--probe-only", action="store_true", help="profile the probe alone, not the norms")
    args = parser.parse_args()
    device = torch.device(args.device)
    if reason := missing_cuda("--device", args.device, "--device cpu"):
        raise SystemExit(refused("gpu_profile.py", reason))

    subject = gpt_subject(args.size, device)
    ids = token_ids(args.tokens)

    def section(name: str, fn: Callable[[], object], probe_scope: bool = False) -> str:
        return profiled(name, fn, device, args.rows, probe_scope=probe_scope)

    where = f"{args.size}, {args.tokens} tokens"
    sections = [
        section(f"plain forward, {where}", lambda: plain_forward(subject, ids, args.batch_size)),
        section(f"angle probe K=0, {where}", lambda: probe(subject, ids, args.batch_size, null=0,
                                                           energy_and_rows=False), probe_scope=True),
    ]
    if args.probe_only:
        sections.append(section(f"angle probe K=64 +energy, {where}",
                                lambda: probe(subject, ids, args.batch_size), probe_scope=True))
    x = torch.randn(args.norm_tokens, args.dim, device=device).requires_grad_()
    dy = torch.randn(args.norm_tokens, args.dim, device=device)
    for impl in () if args.probe_only else ("stock", "compiled"):
        for kind in ("layer", "rms"):
            norm = make_norm(kind, args.dim, EPS, impl=impl).to(device)
            run = forward_backward(norm, x, dy)
            run()  # compilation outside the profile
            name = f"{impl} {kind} forward + backward, {args.norm_tokens} × {args.dim}"
            sections.append(section(name, run))
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    command = shlex.join(["python", "bench/gpu_profile.py", *sys.argv[1:]])
    page = (f"# Where the GPU time goes\n\nGenerated by `{command}` on {utc_stamp()}: {machine}, torch "
            f"{torch.__version__}. Do not edit: run it again.\n\n" + "\n".join(sections))
    print(page)
    if args.out is not None:
        args.out.write_text(page)


if __name__ == "__main__":
    main()
