"""The end-of-run summary (losses, steps, tokens, wall time, where the outputs are): printed when train.py
ends and kept in ``<run_dir>/summary.json``; every session that ends on its own feet (an interrupted or
requeued one too) writes it, so that the next counts it. The wall time is Lightning's ``Timer``, restored on
resume: the training time behind the checkpointed state (a killed session's up to its last checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.loggers import WandbLogger

from corpus.atomic import atomic_open
from normgeo.runs.run_config import SUMMARY_FILE, TRAIN_LOG


def session_wall_s(trainer: L.Trainer, timer: Timer) -> float:
    """This session's training time (validation and probes included): the Timer's, less what it restored.
    A session ended by a signal or a divergence skips ``on_train_end``: its clock is stopped here, so that
    this time and the run's (``timer.time_elapsed()``) are read at one instant and a first session's agree."""
    started = timer.start_time()
    if started is None:
        return 0.0
    if timer.end_time() is None:
        timer.on_train_end(trainer, trainer.lightning_module)
    return timer.end_time() - started


def _metric(trainer: L.Trainer, name: str) -> float | None:
    value = trainer.callback_metrics.get(name)
    return None if value is None else float(value)


def _log_dir(logger: Any) -> str | None:
    if isinstance(logger, WandbLogger):
        return str(Path(logger.experiment.dir).parent)  # wandb/<offline->run-<time>-<id>
    return getattr(logger, "log_dir", None)


def run_summary(trainer: L.Trainer, timer: Timer, run_dir: Path, start_step: int,
                stopped_by: str | None = None) -> dict[str, Any]:
    """The run's summary after this session (begun at ``start_step``), merged with the earlier sessions';
    ``stopped_by``: why the session ended early ("interrupted by SIGINT", "requeue"). Its figures are listed
    once drawn (train.py)."""
    previous = read_summary(run_dir) if start_step > 0 else {}
    step, tokens_per_step = trainer.global_step, trainer.lightning_module.tokens_per_step
    session_tokens = (step - start_step) * tokens_per_step
    session_s = session_wall_s(trainer, timer)
    this_session = {"steps": [start_step, step], "wall_s": round(session_s, 3),
                    "ended": stopped_by or ("finished" if step >= trainer.max_steps else "stopped")}
    return {
        "step": step, "max_steps": trainer.max_steps, "finished": step >= trainer.max_steps,
        "train_loss": _metric(trainer, "train/loss"), "val_loss": _metric(trainer, "val/loss"),
        "val_step": getattr(trainer.lightning_module, "validated_at", None),  # the validation it is from
        "tokens_seen": step * tokens_per_step, "wall_s": round(timer.time_elapsed(), 3),
        "sessions": int(previous.get("sessions") or 0) + 1, "session_wall_s": round(session_s, 3),
        # One entry per session that wrote a summary (a summary from before this list: none for its sessions).
        "session_log": [*previous.get("session_log", []), this_session],
        "tokens_per_s": round(session_tokens / session_s, 1) if session_s > 0 else None,
        "records": str(run_dir / "angles.jsonl") if (run_dir / "angles.jsonl").is_file() else None,
        "figures": [], "checkpoints": str(run_dir / "checkpoints"),
        "logs": {type(logger).__name__: _log_dir(logger) for logger in trainer.loggers},
        "train_log": str(run_dir / TRAIN_LOG), "disk_bytes": disk_use(run_dir),
    }


def disk_use(run_dir: Path) -> dict[str, int]:
    """Bytes on disk of the run: its checkpoints, its records (*.jsonl), and everything in the directory."""
    parts = {"checkpoints": (run_dir / "checkpoints").rglob("*"), "records": run_dir.glob("*.jsonl"),
             "total": run_dir.rglob("*")}
    return {part: sum(p.stat().st_size for p in paths if p.is_file()) for part, paths in parts.items()}


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    with atomic_open(Path(run_dir) / SUMMARY_FILE, "w", encoding="utf-8") as handle:
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
