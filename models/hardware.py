"""The default training precision of the accelerator, its dense peak FLOP/s (the MFU denominator), and
whether an asked-for CUDA device exists on this machine."""

from __future__ import annotations

import re

import torch
from lightning.fabric.utilities.throughput import get_available_flops

CUDA_NAMES = ("gpu", "cuda")  # Lightning's accelerator names that need a CUDA GPU

# Lightning's table finds no H200 named as CUDA reports it ("NVIDIA H200": its rows need "sxm1" or "nvl1"),
# and its H200 rows hold the with-sparsity figures. The H200 SXM has the H100 SXM's tensor cores and clocks:
# NVIDIA's H200 datasheet gives BF16 1,979 TFLOPS with sparsity, 989.4 dense.
H200_DENSE_FLOPS: dict[torch.dtype, float] = {torch.bfloat16: 989.4e12, torch.float16: 989.4e12,
                                               torch.float32: 66.9e12}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device`` in ``dtype``: Lightning's get_available_flops, the H200 added; None on
    the CPU and on GPUs neither knows (no MFU then)."""
    if device.type != "cuda":
        return None
    if "h200" in torch.cuda.get_device_name(device).lower():
        return H200_DENSE_FLOPS.get(dtype)
    return get_available_flops(device, dtype)


def missing_cuda(key: str, device: str, fallback: str) -> str | None:
    """Why ``key=device`` (``cuda``, ``cuda:N``, Lightning's ``gpu``) cannot run here, or None: one line
    naming the key, what this machine has and ``fallback``, the setting that runs without it."""
    match = re.fullmatch(r"(gpu|cuda)(?::(\d+))?", str(device).strip().lower())
    if match is None:
        return None
    if not torch.cuda.is_available():
        built = f"torch {torch.__version__} was built without CUDA" if torch.version.cuda is None else (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU or driver")
        return f"{key}={device}: no CUDA GPU on this machine ({built}); use {fallback}"
    if match.group(2) is not None and int(match.group(2)) >= torch.cuda.device_count():
        return f"{key}={device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0; use {fallback}"
    return None


def default_precision() -> str:
    """bf16 mixed precision where the GPU supports it, fp32 elsewhere (CPU training stays exact)."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"
