"""Forward + backward time of each norm arm's module alone, per implementation, against the memory floor.

Per width ``d`` each arm of ``NORM_ARMS`` runs ``y = norm(x)`` on ``(tokens, d)`` and its backward for a
fixed ``dy``, per implementation: ``stock``, ``compiled`` (``torch.compile``: equal kernel quality) and
``liger`` (CUDA, where ``liger_kernel`` is installed); interleaved, the order rotated per repeat. Medians, the
LayerNorm/RMSNorm ratios, and the share of the floor (the bytes a norm must move over the copy bandwidth of
the same run). docs/benchmarks.md explains the method. fp32 unless ``--dtype``.

    python bench/norm_cost.py                   # d = 512, 768, 1024, 2048 over 8,192 tokens, stock + compiled
    python bench/norm_cost.py --repeats 9 --markdown
    python bench/norm_cost.py --impls stock     # no compiler needed

``--convert SIZE`` times a whole model instead: the eval forward of a Pre-LN ``layer`` model of a paper size
against its RMSNorm conversion (``python -m normgeo.export --to hf --as rms``), both in the exported model
code, eager and ``torch.compile``'d, interleaved as above.

    python bench/norm_cost.py --convert 70m --repeats 5
"""

from __future__ import annotations

import contextlib
import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from benchlib import markdown_table, per_call_seconds, refused, rotated, script_parser, synchronize
from omegaconf import OmegaConf
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from models.export.hf import to_hf
from models.gpt import GPT, GPTConfig
from models.hardware import DTYPES
from models.norms import NORM_ARMS, NORM_IMPLS, compile_refusal, make_norm

REFERENCE = "rms"
EPS = 1e-5
LIGER = "liger"
# The ratios that answer "is RMSNorm cheaper": the paper's two arms, and mean subtraction alone (no bias).
RATIOS = (("layer", REFERENCE), ("layer_nobias", REFERENCE))
BENCHED_DTYPES = ("float32", "bfloat16")  # of models.hardware.DTYPES
SIZES = Path(__file__).resolve().parent.parent / "conf" / "train" / "size"
CONVERT_MODELS = ("original", "converted")
# The ops (and their kernels, and Inductor's kernels named after the ops they fuse) that are a norm's work.
NORM_NAME = re.compile(r"layer_?norm|rms_?norm", re.IGNORECASE)
TOP_KERNELS = 8
KERNEL_CALLS = 20  # forward + backward calls under the profiler per arm: kernel time varies little


@dataclass
class ArmResult:
    impl: str
    kind: str
    dim: int
    floor_bytes: int
    seconds: list[float] = field(default_factory=list)  # one per repeat, per forward + backward
    kernel_seconds: float = math.nan  # its kernels' device time per forward + backward (kernel_seconds())

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def liger_builders() -> dict[str, Callable[[int], nn.Module]]:
    """Liger's modules for the arms it has (its LayerNorm always carries a bias: the ``layer`` arm)."""
    # Optional (GPU kernels): only when it is installed and asked for.
    from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm

    def rms(dim: int) -> nn.Module:
        try:  # in_place=False: Liger's default overwrites dy in the backward, and dy is reused here
            return LigerRMSNorm(dim, eps=EPS, in_place=False)
        except TypeError:  # releases without in_place
            return LigerRMSNorm(dim, eps=EPS)

    # bias=False only sets the bias's initial value to zero (as nn.LayerNorm's); the bias is still learned.
    return {"layer": lambda dim: LigerLayerNorm(dim, eps=EPS, bias=False), REFERENCE: rms}


def available_impls(device: torch.device) -> list[str]:
    """stock and compiled everywhere; liger on CUDA where liger_kernel imports."""
    if device.type == "cuda":
        with contextlib.suppress(ImportError):
            liger_builders()
            return [*NORM_IMPLS, LIGER]
    return list(NORM_IMPLS)


def build(impl: str, kind: str, dim: int) -> nn.Module | None:
    """The arm's module in ``impl``; None where that implementation has no such arm."""
    if impl == LIGER:
        builder = liger_builders().get(kind)
        return builder(dim) if builder is not None else None
    return make_norm(kind, dim, EPS, impl=impl)


def floor_bytes(norm: nn.Module, tokens: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes a forward + backward must move at least: x, y, x again, dy, dx; params twice, grads once."""
    activation = tokens * dim * dtype.itemsize
    parameters = sum(p.numel() * p.element_size() for p in norm.parameters())
    return 5 * activation + 3 * parameters


def forward_backward(norm: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], tuple]:
    """One training-time use of the norm; autograd.grad, not backward(): nothing accumulates across calls."""
    inputs = (x, *norm.parameters())

    def run() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(norm(x), inputs, dy)

    return run


def names_norm(event) -> bool:
    """Whether a profiled ``event`` or an op enclosing it is a norm's (forward or backward)."""
    while event is not None:
        if NORM_NAME.search(event.name):
            return True
        event = event.cpu_parent
    return False


def kernel_shares(events: Sequence, cuda: bool) -> dict:
    """Total and norm kernel time (us) of profiled ``events`` (``prof.events()``), and the top kernels.

    CUDA: every device kernel (and copy), not the annotation ranges; a kernel is the norm's when its own name
    names a norm (Inductor names its kernels after the ops they fuse) or the op that launched it does (eager
    kernels of a norm op, e.g. the weight gradient's reduction). CPU: the self time of every aten op, the
    norm's under a norm op."""
    by_name: dict[str, float] = {}
    if cuda:
        total = norm = 0.0
        # A user annotation's device range (Optimizer.step#AdamW.step) spans kernels counted on their own.
        device = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        for kernel in device:
            us = kernel.time_range.elapsed_us()
            total += us
            by_name[kernel.name] = by_name.get(kernel.name, 0.0) + us
            norm += us if NORM_NAME.search(kernel.name) else 0.0
        # Kernels whose own name says nothing, launched by a
        # norm op (eager LayerNorm's weight-gradient kernel).
        for event in events:
            if event.device_type == DeviceType.CPU and event.kernels and names_norm(event):
                norm += sum(k.duration for k in event.kernels if not NORM_NAME.search(k.name))
    else:
        ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        total = sum(e.self_cpu_time_total for e in ops)
        norm = sum(e.self_cpu_time_total for e in ops if names_norm(e))
        for e in ops:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.self_cpu_time_total
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return {"total_us": total, "norm_us": norm, "norm_share": norm / total if total else None,
            "top": [{"name": name, "us": us, "share": us / total if total else None} for name, us in top]}


def profiled_kernels(fn: Callable[[], object], number: int, device: torch.device) -> dict:
    """:func:`kernel_shares` of ``number`` calls of ``fn`` under torch.profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(number):
            fn()
        synchronize(device)
    return kernel_shares([e for e in prof.events() if not e.is_async], cuda=device.type == "cuda")


def kernel_seconds(fn: Callable[[], object], number: int, device: torch.device) -> float:
    """Device time of one call's kernels, the mean over ``number`` calls: without the host's Python, dispatch
    and launches that a wall clock counts (a compiled module's guards cost more than its kernels at these
    sizes). On the CPU the aten ops' self time; NaN where none ran (Inductor's C++ kernels are no events)."""
    total_us = profiled_kernels(fn, number, device)["total_us"]
    return total_us / 1e6 / number if total_us else math.nan


def calls_for(fn: Callable[[], object], target_s: float, device: torch.device) -> int:
    """Warm up (compilation, allocator, dispatch); the calls per measurement of about ``target_s``."""
    per_call_seconds(fn, 2, device)
    once = per_call_seconds(fn, 1, device)
    return max(1, round(target_s / max(once, 1e-9)))


def measure(
    dims: list[int], impls: list[str], tokens: int, repeats: int, copy_mib: int, target_s: float,
    device: torch.device, dtype: torch.dtype,
) -> tuple[list[ArmResult], list[float]]:
    generator = torch.Generator(device=device).manual_seed(0)
    src = torch.empty(copy_mib * 2**20 // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    src.normal_(generator=generator)
    copy = partial(dst.copy_, src)
    copy_number = calls_for(copy, target_s, device)
    bandwidths: list[float] = []
    results: list[ArmResult] = []
    plans = []  # (result, forward + backward, calls per measurement)
    for dim in dims:
        x = torch.randn(tokens, dim, generator=generator, device=device, dtype=dtype).requires_grad_()
        dy = torch.randn(tokens, dim, generator=generator, device=device, dtype=dtype)
        for impl in impls:
            for kind in NORM_ARMS:
                norm = build(impl, kind, dim)
                if norm is None:
                    continue
                norm = norm.to(device=device, dtype=dtype)
                fn = forward_backward(norm, x, dy)
                result = ArmResult(impl, kind, dim, floor_bytes(norm, tokens, dim, dtype))
                results.append(result)
                plans.append((result, fn, calls_for(fn, target_s, device)))
    for repeat in range(repeats):
        # The copy bandwidth in every repeat too: the floor is measured under the same load as the norms.
        bandwidths.append(2 * src.numel() * src.element_size() / per_call_seconds(copy, copy_number, device))
        for result, fn, number in rotated(plans, repeat):
            result.seconds.append(per_call_seconds(fn, number, device))
    for result, fn, number in plans:  # kernel time is not the host's: one profiled measurement suffices
        result.kernel_seconds = kernel_seconds(fn, min(number, KERNEL_CALLS), device)
    return results, bandwidths


def rows(results: list[ArmResult], bandwidth: float) -> list[dict]:
    """Per (d, implementation, arm): median, ratio to that width's and implementation's rms, to the floor."""
    reference = {(r.dim, r.impl): r.median for r in results if r.kind == REFERENCE}
    return [
        {
            "dim": r.dim,
            "impl": r.impl,
            "kind": r.kind,
            "median_ms": 1e3 * r.median,
            "to_rms": r.median / reference[r.dim, r.impl] if (r.dim, r.impl) in reference else math.nan,
            "to_floor": r.median / (r.floor_bytes / bandwidth),
            "floor_ms": 1e3 * r.floor_bytes / bandwidth,
            "kernel_ms": 1e3 * r.kernel_seconds,
            "kernel_to_floor": r.kernel_seconds / (r.floor_bytes / bandwidth),
            "all_ms": [1e3 * s for s in r.seconds],
        }
        for r in results
    ]


def ratios(table: list[dict]) -> list[dict]:
    """Per (d, implementation) and pair of RATIOS: the medians' ratio, and the range of the per-repeat ratios
    (both arms are timed within each repeat, so a repeat's ratio sees one load of a shared machine)."""
    by_key = {(row["dim"], row["impl"], row["kind"]): row for row in table}
    out = []
    for dim, impl in dict.fromkeys((row["dim"], row["impl"]) for row in table):
        pair_row: dict = {"dim": dim, "impl": impl}
        for a, b in RATIOS:
            top, bottom = by_key.get((dim, impl, a)), by_key.get((dim, impl, b))
            if top is None or bottom is None:
                pair_row[f"{a} / {b}"], pair_row[f"{a} / {b} range"] = math.nan, (math.nan, math.nan)
                continue
            per_repeat = [x / y for x, y in zip(top["all_ms"], bottom["all_ms"], strict=True)]
            pair_row[f"{a} / {b}"] = top["median_ms"] / bottom["median_ms"]
            pair_row[f"{a} / {b} range"] = (min(per_repeat), max(per_repeat))
        out.append(pair_row)
    return out


def convert_cost(size: str, seq: int, impls: list[str], repeats: int, device: torch.device) -> None:
    """--convert: the forward of a ``layer`` model of ``size`` against its RMSNorm conversion, per
    implementation."""
    preset = OmegaConf.load(SIZES / f"{size}.yaml")
    gpt = GPT(GPTConfig(n_layer=preset.n_layer, n_head=preset.n_head, n_embd=preset.n_embd, block_size=seq,
                        norm="layer", tie_embeddings=False)).eval()
    ids = torch.randint(0, gpt.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    built = {"original": to_hf(gpt, model_code=True), "converted": to_hf(gpt, as_rms=True)}
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for impl in impls:
        for name in CONVERT_MODELS:
            model = built[name].to(device)
            model = torch.compile(model, dynamic=False) if impl == "compiled" else model

            def forward(model: nn.Module = model) -> object:
                with torch.inference_mode():
                    return model(ids).logits

            calls[impl, name] = forward
            for _ in range(2):  # warm-up (and compilation)
                forward()
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for repeat in range(repeats):
        for key in rotated(list(calls), repeat):
            seconds[key].append(per_call_seconds(calls[key], 1, device))
    print(
        f"device: {device_name(device)}, float32, torch {torch.__version__}; {size} `layer` arm "
        f"({gpt.num_parameters():,} parameters) and its RMSNorm conversion, eval forward over 1 x {seq} "
        f"tokens; {repeats} interleaved repeats, median shown\n"
    )
    header = ["implementation", "original (LayerNorm)", "converted (RMSNorm)", "converted / original",
              "per repeat"]
    rows = []
    for impl in impls:
        original, converted = seconds[impl, "original"], seconds[impl, "converted"]
        per_repeat = [c / o for c, o in zip(converted, original, strict=True)]
        original_s, converted_s = statistics.median(original), statistics.median(converted)
        rows.append([impl, f"{original_s * 1e3:.1f} ms", f"{converted_s * 1e3:.1f} ms",
                     f"{converted_s / original_s:.3f}", f"{min(per_repeat):.3f}-{max(per_repeat):.3f}"])
    print(markdown_table(header, rows))


def device_name(device: torch.device) -> str:
    cuda = device.type == "cuda"
    return torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"


def floor_share(to_floor: float) -> str:
    """The floor's time as a share of the measured time ("-" where nothing was measured)."""
    return f"{1 / to_floor:.0%}" if to_floor and math.isfinite(to_floor) else "-"


def refuse(message: str) -> None:
    raise SystemExit(refused("norm_cost.py", message))


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--dims", default="512,768,1024,2048", help="comma-separated widths d")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the (tokens, d) input")
    parser.add_argument("--impls", default=None,
                        help=f"comma-separated implementations, of {', '.join([*NORM_IMPLS, LIGER])} "
                        f"(default: {', '.join(NORM_IMPLS)}, and {LIGER} on CUDA where liger_kernel is "
                        "installed)")
    parser.add_argument("--dtype", default="float32", choices=BENCHED_DTYPES,
                        help="the input's and parameters' dtype")
    parser.add_argument("--repeats", type=int, default=7,
                        help="interleaved measurements per arm; the median is shown")
    parser.add_argument("--copy-mib", type=int, default=256,
                        help="size of the copy that measures the bandwidth")
    parser.add_argument("--target-ms", type=float, default=40.0, help="about this long per measurement")
    parser.add_argument("--markdown", action="store_true", help="also print markdown tables at the end")
    parser.add_argument("--convert", metavar="SIZE", default=None,
                        help="time a Pre-LN LayerNorm model of this conf/train/size preset against its "
                        "RMSNorm conversion instead (stock and compiled)")
    parser.add_argument("--seq", type=int, default=1024, help="--convert: tokens per forward")
    args = parser.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    available = [impl for impl in available_impls(device) if not args.convert or impl in NORM_IMPLS]
    impls = available if args.impls is None else args.impls.split(",")
    if unknown := [impl for impl in impls if impl not in available]:
        refuse(f"--impls {','.join(unknown)}: not available here; choose from {', '.join(available)}")
    if "compiled" in impls:
        if refusal := compile_refusal(device.type):
            refuse(f"--impls compiled: {refusal}; or run with --impls stock")
        # Every compiled nn forward shares one dynamo cache (torch wraps it in one function), one entry per
        # (arm, width): room for all, and an error rather than a silent eager fallback if that is not enough.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(dims) * len(NORM_ARMS))
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    if args.convert:
        if not (SIZES / f"{args.convert}.yaml").is_file():
            refuse(f"--convert {args.convert}: no such size; choose from "
                   f"{', '.join(sorted(p.stem for p in SIZES.glob('*.yaml')))}")
        convert_cost(args.convert, args.seq, impls, args.repeats, device)
        return
    results, bandwidths = measure(dims, impls, args.tokens, args.repeats, args.copy_mib, args.target_ms / 1e3,
                                  device, DTYPES[args.dtype])
    bandwidth = statistics.median(bandwidths)
    table = rows(results, bandwidth)
    pairs = ratios(table)
    print(
        f"device: {device_name(device)}, {args.dtype}, torch {torch.__version__}; {args.tokens} tokens; "
        f"implementations: {', '.join(impls)}; {args.repeats} interleaved repeats, median shown; arms: "
        f"{', '.join(NORM_ARMS)}"
    )
    if device.type == "cuda":
        fused = hasattr(torch.ops.aten, "_fused_rms_norm")
        kernel = "torch fused RMSNorm kernel (aten._fused_rms_norm)" if fused else "composite ops"
        print(f"stock rms on CUDA: {kernel}")
    print(f"copy bandwidth (read + write, {args.copy_mib} MiB copy): median {bandwidth / 1e9:.2f} GB/s, "
          f"all {', '.join(f'{b / 1e9:.2f}' for b in bandwidths)}")
    for row in table:
        print(f"d={row['dim']:<5d} {row['impl']:9s} {row['kind']:13s} median {row['median_ms']:8.3f} ms   "
              f"to rms {row['to_rms']:6.3f}   floor {row['floor_ms']:7.3f} ms   to floor "
              f"{row['to_floor']:6.2f}   kernels {row['kernel_ms']:8.3f} ms   kernels to floor "
              f"{row['kernel_to_floor']:6.2f}   "
              f"all {', '.join(f'{v:.3f}' for v in row['all_ms'])}")
    names = [f"{a} / {b}" for a, b in RATIOS]
    for pair in pairs:
        print(f"d={pair['dim']:<5d} {pair['impl']:9s} " + "   ".join(
            f"{name} {pair[name]:.3f} (repeats {pair[f'{name} range'][0]:.3f}-{pair[f'{name} range'][1]:.3f})"
            for name in names))
    if args.markdown:
        print("\n" + markdown_table(
            ["d", "implementation", "arm", "fwd+bwd median (ms)", f"/ {REFERENCE}", "floor (ms)", "/ floor",
             "kernels (ms)", "floor / kernels", "all repeats (ms)"],
            [[row["dim"], row["impl"], f"`{row['kind']}`", f"{row['median_ms']:.3f}", f"{row['to_rms']:.3f}",
              f"{row['floor_ms']:.3f}", f"{row['to_floor']:.2f}", f"{row['kernel_ms']:.3f}",
              floor_share(row["kernel_to_floor"]), ", ".join(f"{v:.2f}" for v in row["all_ms"])]
             for row in table]))
        header, ratio_rows = ["d", "implementation"], [[pair["dim"], pair["impl"]] for pair in pairs]
        for (a, b), name in zip(RATIOS, names, strict=True):
            header += [f"`{a}` / `{b}` (medians)", "per repeat"]
            for cells, pair in zip(ratio_rows, pairs, strict=True):
                low, high = pair[f"{name} range"]
                cells += [f"{pair[name]:.3f}", f"{low:.3f}-{high:.3f}"]
        print("\n" + markdown_table(header, ratio_rows))


if __name__ == "__main__":
    main()
