"""The paper grid's plan on four GPU types, as a markdown table: ``python docs/plan_table.py > docs/plan.md``.

For every ``experiment=paper_<size> norm=<layer|rms>`` (the paper's DDP runs, bf16-mixed, on the size's
GPU count): whether the configured micro_batch fits, the largest that does, the GPU-hours at 40% MFU and
the disk the checkpoint schedule fills. Planned by ``python -m normgeo.plan`` (fake tensors), not measured.
"""

from __future__ import annotations

import sys

from models.plan import GPUS
from normgeo.plan import compose, plan_config

SIZES = ("70m", "160m", "410m", "1b")
NORMS = ("layer", "rms")


def main() -> None:
    names = ", ".join(g.name for g in GPUS.values())
    print("# Planned cost of the paper grid\n")
    print("Planned, not measured: `python -m normgeo.plan` on fake tensors (models/plan.py), written by "
          "`python docs/plan_table.py > docs/plan.md`. DDP over the size's GPU count (`size.gpus`), "
          "bf16-mixed, global batch 64 x 1024 tokens, no activation checkpointing. *fits*: the configured "
          "micro_batch's planned peak x 1.1 + 1.5 GiB within the card; *largest*: the largest micro_batch "
          "dividing 64 / GPUs that fits (peaks traced at two micro-batches, extrapolated linearly); "
          f"GPU-hours at 40% MFU of the dense bf16 peak; disk: the checkpoint schedule (weights-only "
          f"checkpoints + the full `last.ckpt`). GPUs: {names}.\n")
    header = ["run", "GPUs", "micro_batch", "peak GiB/GPU"]
    for key in GPUS:
        header += [f"{key} fits", f"{key} largest", f"{key} GPU-h"]
    header.append("disk GB")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    totals = dict.fromkeys(GPUS, 0.0)
    for size in SIZES:
        for norm in NORMS:
            cfg = compose([f"experiment=paper_{size}", f"norm={norm}"])
            plan, report = plan_config(cfg, both_checkpointing=False, probe=False)
            row = [f"{size} {norm}", str(plan.setup.world_size), str(plan.setup.micro_batch),
                   f"{plan.configured.memory.total / 2**30:.1f}"]
            for gpu in report["gpus"]:
                largest = gpu["largest_micro_batch_no_ac"]
                row += ["yes" if gpu["fits_no_ac"] else "**no**", "none" if largest is None else str(largest),
                        f"{gpu['gpu_hours']:,.0f}"]
                totals[gpu["gpu"]] += gpu["gpu_hours"]
            row.append(f"{report['disk']['total_bytes'] / 1e9:.1f}")
            print("| " + " | ".join(row) + " |")
            sys.stdout.flush()
    print("\nGPU-hours of the whole grid (8 runs) at 40% MFU: "
          + ", ".join(f"{GPUS[k].name} {v:,.0f}" for k, v in totals.items()) + ".")


if __name__ == "__main__":
    main()
