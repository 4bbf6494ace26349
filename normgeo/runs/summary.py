"""The end-of-run summary file (losses, steps, tokens, wall time, where the outputs are): ``<run_dir>/
summary.json``, written by train.py's end (``run_summary`` reads the Trainer) and printed. No Lightning here:
the readers (normgeo.status, normgeo.compare, normgeo.export) import this and stay quick to start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from corpus.atomic import atomic_open
from normgeo.run_folder import RunFolder


def disk_use(run_dir: Path) -> dict[str, int]:
    """Bytes on disk of the run: its checkpoints, its records (*.jsonl), and everything in the directory."""
    parts = {"checkpoints": RunFolder(run_dir).checkpoints.rglob("*"), "records": run_dir.glob("*.jsonl"),
             "total": run_dir.rglob("*")}
    return {part: sum(p.stat().st_size for p in paths if p.is_file()) for part, paths in parts.items()}


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = RunFolder(run_dir).summary
    return json.loads(path.read_text()) if path.is_file() else {}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    with atomic_open(RunFolder(run_dir).summary, "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)


def format_summary(summary: dict[str, Any]) -> str:
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    validated = f" (step {summary['val_step']})" if summary.get("val_step") is not None else ""
    lines = [
        f"run summary: step {summary['step']}/{summary['max_steps']}"
        f"{' (finished)' if summary['finished'] else ''} · train loss {number(summary['train_loss'], '.4f')}"
        f" · val loss {number(summary['val_loss'], '.4f')}{validated} · {summary['tokens_seen']:,} tokens"
        f" · {number(summary['tokens_per_s'], ',.0f')} tok/s overall (the session's tokens over its "
        f"wall time: start-up, probes and validation included) · wall {summary['wall_s']:.1f} s",
        f"  records:     {summary['records'] or '-'}",
        f"  figures:     {len(summary['figures'])} in "
        f"{Path(summary['figures'][0]).parent if summary['figures'] else '-'}",
        f"  checkpoints: {summary['checkpoints']}"]
    lines += [f"  logs:        {name}: {where}" for name, where in summary["logs"].items()]
    lines.append(f"  train log:   {summary['train_log']}")
    return "\n".join(lines)
