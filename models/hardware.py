"""The default training precision of the accelerator (peak FLOP/s for MFU: Lightning's get_available_flops),
and whether an asked-for CUDA device exists on this machine."""

from __future__ import annotations

import re

import torch

CUDA_NAMES = ("gpu", "cuda")  # Lightning's accelerator names that need a CUDA GPU
# The dtypes a config names (FSDP2's parameter and reduce dtypes, the plan's, a pretrained model's).
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
        return (f"{key}={device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered "
                f"from 0; use {fallback}")
    return None


def default_precision() -> str:
    """bf16 mixed precision where the GPU supports it, fp32 elsewhere (CPU training stays exact)."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"
