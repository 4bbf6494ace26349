"""A toy norm arm defined only in the tests: RMSNorm without eps, y = gain * sqrt(d) * x / ||x||.

``python tests/toy_arm.py <train.py overrides>`` registers it (module, YAML node in Hydra's ConfigStore)
and runs train.py's real entry point, so the arm flows through training and the probe exactly as a
built-in one; the tests register it in their own process for compare and the verdict.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.norms import NORM_ARMS, NormArm, register_arm  # noqa: E402

TOY = "toy_l2"


class ScaledL2Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = 0.0
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * math.sqrt(x.shape[-1]) * x / x.norm(dim=-1, keepdim=True)


def register() -> None:
    if TOY not in NORM_ARMS:
        register_arm(
            NormArm(
                TOY,
                ScaledL2Norm,
                lambda dim, eps, role: {"dim": dim},
                "rms",
                "toy L2 norm",
                "tab:purple",
                "scaling by the L2 norm, no eps (a test's toy arm)",
                contrasts=(("layer", "the toy vs LayerNorm"),),
                transformer_lens_lacks="its RMSNorm has an eps",
            )
        )


if __name__ == "__main__":
    from hydra.core.config_store import ConfigStore

    register()
    ConfigStore.instance().store(group="norm", name=TOY, node={"name": TOY, "eps": 1e-5})
    import train

    sys.argv = ["train.py", *sys.argv[1:]]
    train.main()
