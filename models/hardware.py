"""What the accelerator can do: bf16 support and peak dense FLOP/s for model-FLOPs utilization."""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, matched by substring of the
# device name, most specific first. Unknown devices and CPUs report no MFU rather than a wrong one.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("A40", 150e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 tensor cores; V100 has no bf16
    ("T4", 65e12),
)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def default_precision() -> str:
    """bf16 mixed precision where the GPU supports it, fp32 elsewhere (CPU training stays exact)."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"
