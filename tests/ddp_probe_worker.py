"""Run the angle probe in N gloo processes and write the merged rows (used by test_probe.py).

    python tests/ddp_probe_worker.py <world_size> <out.json>
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.gpt import GPT, GPTConfig  # noqa: E402
from normgeo.measure.pipeline import measure_records  # noqa: E402
from normgeo.measure.probe import make_references  # noqa: E402
from normgeo.measure.probe_config import BootstrapConfig, ProbeConfig  # noqa: E402
from normgeo.run_folder import INTERVENTION_POSITIONS_FILE, MEAN_SOURCES_FILE  # noqa: E402

SEPARATOR = 50256
# Documents end mid-window, at a window's last token (the next starts the next window, on the other rank)
# and at the tail's first token: with the stream's first token, 8 document starts in windows 0 (2), 2, 3 (2),
# 14, 15 and the tail (24): on both ranks of 2, every one at a position with a next token.
DOCUMENT_ENDS = (9, 31, 47, 60, 230, 250, 24 * 16)
DOCUMENT_STARTS, DOCUMENT_WINDOWS = 8, 6


def probe_rows(rank: int, world: int) -> dict[str, list[dict]]:
    """angles.jsonl, null.jsonl, intervention.jsonl, intervention_positions.jsonl and mean_sources.jsonl
    rows, by the callback's own call: each rank probes every world-th window (24 full ones and a 7-token
    tail), its documents separated by GPT-2's end-of-text (SEPARATOR at DOCUMENT_ENDS)."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, norm="layer"), seed=3)
    ids = torch.randint(0, SEPARATOR, (24 * 16 + 7,), generator=torch.Generator().manual_seed(5))
    ids[list(DOCUMENT_ENDS)] = SEPARATOR
    probe = ProbeConfig(tokens=len(ids), seed=0, bootstrap=BootstrapConfig(replicates=200),
                        intervention=["all", "layers"])
    records = measure_records(
        model,
        ids,
        16,
        make_references(32),
        probe,
        batch_size=5,
        model_name="tiny",
        step=0,
        tokens_per_step=0,
        rank=rank,
        world_size=world,
        separator=SEPARATOR,
    )
    return {"angles": records.rows, "null": records.null, "intervention": records.intervention,
            "mean_sources": records.files[MEAN_SOURCES_FILE],
            "intervention_positions": records.files[INTERVENTION_POSITIONS_FILE]}


def worker(rank: int, world: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = probe_rows(rank, world)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(rows, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, out = int(sys.argv[1]), sys.argv[2]
    if world == 1:
        with open(out, "w") as handle:
            json.dump(probe_rows(0, 1), handle)
    else:
        mp.spawn(worker, args=(world, out, sys.argv[3] if len(sys.argv) > 3 else "29533"), nprocs=world)
