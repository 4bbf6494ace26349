"""Shared test set-up: offline hubs, the shared tiktoken cache, and helpers to run train.py for real."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("NORMGEO_SHARED", ROOT.parent / "shared")).resolve()

os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def shared() -> Path:
    if not (SHARED / "corpora").is_dir():
        pytest.skip(f"the shared test data folder {SHARED} is missing (set NORMGEO_SHARED)")
    return SHARED


# Small, fast settings for real training runs on CPU (2 layers, d=32, 64-token context).
FAST = [
    "size=tiny",
    "size.n_embd=32",
    "size.n_head=2",
    "seq_len=64",
    "global_batch=8",
    "micro_batch=4",
    "logger=csv",
    "trainer=cpu",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "log_every=1",
    "val_every=1000",
    "probe.tokens=512",
]


def run_train(run_dir: Path, *overrides: str, check: bool = True, timeout: int = 600, env: dict | None = None):
    """Run ``python train.py`` in a subprocess (Lightning's DDP launcher re-runs sys.argv)."""
    args = [sys.executable, str(ROOT / "train.py"), *FAST, f"run_dir={run_dir}",
            f"data_root={run_dir.parent / 'data'}", *overrides]
    result = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def metrics_rows(run_dir: Path) -> list[dict]:
    """Every CSV logger row of a run, session after session (csv/version_0, version_1, ...)."""
    versions = sorted((run_dir / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    rows = []
    for version in versions:
        if not (version / "metrics.csv").exists():  # a SIGKILLed session never flushed its metrics
            continue
        with open(version / "metrics.csv") as handle:
            rows += list(csv.DictReader(handle))
    return rows


def step_losses(run_dir: Path) -> dict[int, float]:
    """train/loss per optimizer step (logged as step k-1 for the k-th update); a later session wins."""
    return {int(r["step"]): float(r["train/loss"]) for r in metrics_rows(run_dir) if r.get("train/loss")}
