"""Forward + backward time of each norm arm's module alone, next to RMSNorm and to the memory-traffic floor.

For every width ``d`` the input is ``(tokens, d)``; each arm's module (``models.norms.make_norm``, every arm
of ``NORM_ARMS``, so new arms appear here by themselves) runs ``y = norm(x)`` and the gradients of
``y`` w.r.t. ``x`` and the norm's parameters for a fixed upstream gradient ``dy``. The arms are interleaved
within each repeat (order rotated from repeat to repeat) so that drift of a shared machine hits them alike;
the table gives the median over repeats.

Floor: a norm is memory-bound, so its least possible time is the bytes it must move (forward: read x,
write y; backward: read x and dy, write dx; parameters read twice and their gradients written once)
divided by the copy bandwidth of this machine, measured in the same run from ``dst.copy_(src)``
(bandwidth = 2 x bytes / time). fp32 on CPU; bf16 on a GPU when CUDA is available.

    python bench/norm_cost.py                    # d = 512, 768, 1024, 2048 over 8,192 tokens
    python bench/norm_cost.py --repeats 9 --markdown
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.norms import NORM_ARMS, make_norm  # noqa: E402

REFERENCE = "rms"


@dataclass
class ArmResult:
    kind: str
    dim: int
    floor_bytes: int
    seconds: list[float] = field(default_factory=list)  # one per repeat, per forward + backward

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def floor_bytes(norm: nn.Module, tokens: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes a forward + backward must move at least: x, y, x again, dy, dx; params twice, their grads once."""
    activation = tokens * dim * torch.tensor([], dtype=dtype).element_size()
    parameters = sum(p.numel() * p.element_size() for p in norm.parameters())
    return 5 * activation + 3 * parameters


def forward_backward(norm: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """One training-time use of the norm; autograd.grad, not backward(), so nothing accumulates across calls."""
    inputs = (x, *norm.parameters())

    def run() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(norm(x), inputs, dy)

    return run


def per_call_seconds(fn: Callable[[], object], number: int, device: torch.device) -> float:
    """Mean seconds per call over ``number`` back-to-back calls (CUDA: synchronized before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(number):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / number


def calls_for(fn: Callable[[], object], target_s: float, device: torch.device) -> int:
    """Warm up (allocator, first-call dispatch), then the calls per measurement that last about ``target_s``."""
    per_call_seconds(fn, 2, device)
    once = per_call_seconds(fn, 1, device)
    return max(1, round(target_s / max(once, 1e-9)))


def measure(
    dims: list[int], tokens: int, repeats: int, copy_mib: int, target_s: float, device: torch.device,
    dtype: torch.dtype,
) -> tuple[list[ArmResult], list[float]]:
    generator = torch.Generator(device=device).manual_seed(0)
    src = torch.empty(copy_mib * 2**20 // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
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
        for kind in NORM_ARMS:
            norm = make_norm(kind, dim, 1e-5).to(device=device, dtype=dtype)
            fn = forward_backward(norm, x, dy)
            result = ArmResult(kind, dim, floor_bytes(norm, tokens, dim, dtype))
            results.append(result)
            plans.append((result, fn, calls_for(fn, target_s, device)))
    for repeat in range(repeats):
        # The copy bandwidth in every repeat too: the floor is measured under the same load as the norms.
        bandwidths.append(2 * src.numel() * src.element_size() / per_call_seconds(copy, copy_number, device))
        shift = repeat % len(plans)
        for result, fn, number in plans[shift:] + plans[:shift]:
            result.seconds.append(per_call_seconds(fn, number, device))
    return results, bandwidths


def rows(results: list[ArmResult], bandwidth: float) -> list[dict]:
    """Per (d, arm): median, ratio to the same width's rms, ratio to the floor at the median bandwidth."""
    reference = {r.dim: r.median for r in results if r.kind == REFERENCE}
    return [
        {
            "dim": r.dim,
            "kind": r.kind,
            "median_ms": 1e3 * r.median,
            "to_rms": r.median / reference[r.dim] if r.dim in reference else float("nan"),
            "to_floor": r.median / (r.floor_bytes / bandwidth),
            "floor_ms": 1e3 * r.floor_bytes / bandwidth,
            "all_ms": [1e3 * s for s in r.seconds],
        }
        for r in results
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="512,768,1024,2048", help="comma-separated widths d")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the (tokens, d) input")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved measurements per arm; the median is shown")
    parser.add_argument("--copy-mib", type=int, default=256, help="size of the copy that measures the bandwidth")
    parser.add_argument("--target-ms", type=float, default=40.0, help="about this long per measurement")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table at the end")
    args = parser.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"

    results, bandwidths = measure(dims, args.tokens, args.repeats, args.copy_mib, args.target_ms / 1e3, device, dtype)
    bandwidth = statistics.median(bandwidths)
    table = rows(results, bandwidth)
    print(f"device: {name}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}; {args.tokens} tokens; "
          f"{args.repeats} interleaved repeats, median shown; arms: {', '.join(NORM_ARMS)}")
    print(f"copy bandwidth (read + write, {args.copy_mib} MiB copy): median {bandwidth / 1e9:.2f} GB/s, "
          f"all {', '.join(f'{b / 1e9:.2f}' for b in bandwidths)}")
    for row in table:
        print(f"d={row['dim']:<5d} {row['kind']:13s} median {row['median_ms']:8.3f} ms   to rms {row['to_rms']:6.3f}   "
              f"floor {row['floor_ms']:7.3f} ms   to floor {row['to_floor']:6.2f}   "
              f"all {', '.join(f'{v:.3f}' for v in row['all_ms'])}")
    if args.markdown:
        print(f"\n| d | arm | fwd+bwd median (ms) | / {REFERENCE} | floor (ms) | / floor | all repeats (ms) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for row in table:
            print(f"| {row['dim']} | `{row['kind']}` | {row['median_ms']:.3f} | {row['to_rms']:.3f} | "
                  f"{row['floor_ms']:.3f} | {row['to_floor']:.2f} | {', '.join(f'{v:.2f}' for v in row['all_ms'])} |")


if __name__ == "__main__":
    main()
