"""The default training precision of the accelerator (peak FLOP/s for MFU: Lightning's get_available_flops)."""

from __future__ import annotations

import torch


def default_precision() -> str:
    """bf16 mixed precision where the GPU supports it, fp32 elsewhere (CPU training stays exact)."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"
