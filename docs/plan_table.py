"""The paper grid's plan on the GPU types, as markdown: ``python docs/plan_table.py > docs/plan.md``.

For every ``experiment=paper_<size> norm=<layer|rms>`` (the paper's DDP runs, bf16-mixed, on the size's
GPU count): which step it planned (compiled or eager), whether the configured micro_batch fits, the
largest that does, the GPU-hours at 40% MFU and the disk the checkpoint schedule fills. Planned by
``python -m normgeo.plan`` (fake tensors). Then the plan against every peak measured on a GPU
(``docs/measured_peaks.json``).
"""

from __future__ import annotations

import sys
import time

from models.step_cost import GIB, GPUS
from normgeo.plan import MEASURED_PEAKS, compose, measured_overrides, measured_peaks, plan_config

SIZES = ("70m", "160m", "410m", "1b")
NORMS = ("layer", "rms")


def main() -> None:
    names = ", ".join(g.name for g in GPUS.values())
    print("# Planned cost of the paper grid\n")
    print("Planned, not measured: `python -m normgeo.plan` on fake tensors (models/step_cost.py), written by "
          "`python docs/plan_table.py > docs/plan.md`. *planned*: the compiled step where the config "
          "compiles (`compile=true`, or `auto` on a GPU), else the eager trace. DDP over the size's GPU "
          "count (`size.gpus`), "
          "bf16-mixed, global batch 64 x 1024 tokens, no activation checkpointing. *fits*: the configured "
          "micro_batch's planned peak x 1.1 + 1.5 GiB within the card; *largest*: the largest micro_batch "
          "dividing 64 / GPUs that fits (peaks traced at two micro-batches, extrapolated linearly); "
          f"GPU-hours at 40% MFU of the dense bf16 peak; disk: the checkpoint schedule (weights-only "
          f"checkpoints + the full `last.ckpt`). GPUs: {names}.\n")
    header = ["run", "GPUs", "micro_batch", "planned", "peak GiB/GPU",
              *(f"{key} {column}" for key in GPUS for column in ("fits", "largest", "GPU-h")), "disk GB"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    totals = dict.fromkeys(GPUS, 0.0)
    for size in SIZES:
        for norm in NORMS:
            cfg = compose([f"experiment=paper_{size}", f"norm={norm}", f"plan.gpus=[{','.join(GPUS)}]"])
            plan, report = plan_config(cfg, both_checkpointing=False, probe=False)
            row = [f"{size} {norm}", str(plan.setup.world_size), str(plan.setup.micro_batch),
                   report["planned"], f"{plan.configured.memory.total / 2**30:.1f}"]
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
    measured_table()


def measured_table() -> None:
    """Each peak measured on a GPU beside the plan of the same configuration."""
    print("\n## The plan against the GPU\n")
    name = MEASURED_PEAKS.relative_to(MEASURED_PEAKS.parents[1])
    print(f"Every row of `{name}` (the peaks measured on a GPU: "
          "`torch.cuda.max_memory_allocated` over training, one device, bf16-mixed, fused AdamW; "
          "`python -m normgeo.plan --measure --record` adds rows) planned by `python -m normgeo.plan "
          "size=S norm=N micro_batch=B global_batch=G trainer=gpu compile=C`. *planned*: the compiled "
          "step (`models/compiled_plan.py`: the joint graph traced with AOT autograd on fake tensors, "
          "partitioned by Inductor's partition function; a liveness sweep over the buffers Inductor writes: "
          "extern kernels' outputs (matmuls, attention), reductions, scatters, graph outputs (saved "
          "tensors, gradients) and every extern kernel's input; pointwise chains fused unless reused with "
          "more than 4 reads; a fused kernel written in place of a buffer of the same size it reads last, "
          "the backward's saved tensors being donated) plus the static state (parameters, AdamW state, "
          "the gradients of earlier micro-steps when accumulating), or the eager trace (MemTracker over "
          "eager autograd) for compile=false. "
          "Not modelled: allocator fragmentation and rounding, cuBLAS and attention workspaces, the CUDA "
          "context, Inductor's other heuristics that write out fused chains, its kernel reordering, DDP's "
          "graph split at bucket boundaries. *seconds*: the planning time on "
          "this machine (two traces: the configured micro_batch and half of it).\n")
    print("| size | norm | micro_batch | global_batch | planned | plan GiB | measured GiB | plan / measured "
          "| device, date, torch | seconds |")
    print("|" + " --- |" * 10)
    for row in measured_peaks():
        start = time.perf_counter()
        plan, report = plan_config(compose(measured_overrides(row)), both_checkpointing=False, probe=False)
        seconds = time.perf_counter() - start
        peak = plan.configured.memory.total / GIB
        print(f"| {row['size']} | {row['norm']} | {row['micro_batch']} | {row['global_batch']} | "
              f"{report['planned']} | {peak:.2f} | {row['peak_gib']:.2f} | {peak / row['peak_gib']:.3f} | "
              f"{row['device']}, {row['date']}, torch {row['torch']} | {seconds:.0f} |")
        sys.stdout.flush()
    print("\ntrain.py's launch gate (`models.step_cost.gate`, run by `normgeo/runs/preflight.py` before the "
          "run folder is claimed) holds this plan against the GPU (or `plan.device_memory_gib`): it refuses "
          "only when the plan's lower bound, the exact static state (parameters, AdamW state, DDP's buckets "
          "or the gradients accumulated over micro-steps, FSDP2's shards) plus one micro-batch's logits, and "
          "`plan.headroom_gib` exceed the card; between that and the planned peak it warns with the numbers "
          "and the run starts. The refusal names the planned peak (compiled or eager), the card and the "
          "largest micro_batch that fits (`micro_batch=N` starts and resumes; `plan.check=false` too). "
          "The gate traces the configured micro_batch alone unless its peak and `plan.headroom_gib` exceed "
          "the card; then half of it too, for the slope that names the micro_batch that fits. "
          "Rank 0 plans once per run and keeps the plan in `<run_dir>/plan.json` with a hash of what it "
          "planned, written once the start is accepted; other ranks and later sessions read it, a "
          "changed config is planned again, and a kept plan of one trace is traced again on a card it does "
          "not fit.")


if __name__ == "__main__":
    main()
