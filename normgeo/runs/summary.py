"""The end-of-run summary file (losses, steps, tokens, wall time, where the outputs are): ``<run_dir>/
summary.json``, written by a session's end (``callbacks.run.run_summary`` reads the Trainer) and printed.
No Lightning here: the readers (normgeo.status, normgeo.compare, normgeo.export) import this and stay quick
to start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from corpus.atomic import atomic_open
from normgeo.measure.records import DamagedRecords
from normgeo.run_folder import RunFolder
from normgeo.runs.formats import summary_as_today


def disk_use(run_dir: Path) -> dict[str, int]:
    """Bytes on disk of the run: its checkpoints, its records (*.jsonl), and everything in the directory."""
    parts = {"checkpoints": RunFolder(run_dir).checkpoints.rglob("*"), "records": run_dir.glob("*.jsonl"),
             "total": run_dir.rglob("*")}
    return {part: sum(p.stat().st_size for p in paths if p.is_file()) for part, paths in parts.items()}


# summary.json's fields (callbacks.run.run_summary writes them) and what each holds; a key not listed
# (a divergence record, a field of a later version) is not checked, and a missing one reads as unknown.
WHOLE, NUMBER, FLAG, TEXT = "a whole number", "a number", "true or false", "text"
SUMMARY_FIELDS: dict[str, tuple[str, bool]] = {  # key -> (what it holds, whether null is allowed)
    "step": (WHOLE, False), "max_steps": (WHOLE, False), "finished": (FLAG, False),
    "train_loss": (NUMBER, True), "val_loss": (NUMBER, True), "val_step": (WHOLE, True),
    "tokens_seen": (WHOLE, False), "wall_s": (NUMBER, False), "sessions": (WHOLE, False),
    "session_wall_s": (NUMBER, False), "tokens_per_s": (NUMBER, True), "records": (TEXT, True),
    "checkpoints": (TEXT, False), "train_log": (TEXT, False),
}
SUMMARY_FIX = ("copy it again from where the run wrote it (one JSON object: train.py writes it whole at the "
               "end of each session)")


def holds(value: object, kind: str) -> bool:
    """Whether ``value`` (parsed JSON) is ``kind``: true/false is not a number here."""
    if isinstance(value, bool):
        return kind == FLAG
    return {WHOLE: isinstance(value, int), NUMBER: isinstance(value, (int, float)),
            TEXT: isinstance(value, str)}.get(kind, False)


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The run's summary.json ({} when absent), every field of :data:`SUMMARY_FIELDS` of its type; raises
    :class:`DamagedRecords` naming the file, the key's line and what it expected. The one summary reader:
    train.py's resume and end, ``status``, ``compare``, ``report``, the pilot."""
    path = RunFolder(run_dir).summary
    if not path.is_file():
        return {}
    text = path.read_text(errors="replace")
    if not text.strip():
        raise DamagedRecords(path, 1, "empty: no summary in it", SUMMARY_FIX, what="summary")
    try:
        summary = json.loads(text)
    except json.JSONDecodeError as err:
        raise DamagedRecords(path, err.lineno, f"{err.msg} at column {err.colno}", SUMMARY_FIX,
                             what="summary") from None
    if not isinstance(summary, dict):
        raise DamagedRecords(path, 1, f"a JSON {type(summary).__name__}, not an object", SUMMARY_FIX,
                             what="summary")
    for key, (kind, nullable) in SUMMARY_FIELDS.items():
        value = summary.get(key)
        if key in summary and not (value is None and nullable) and not holds(value, kind):
            line = next((number for number, row in enumerate(text.splitlines(), 1) if f'"{key}"' in row), 1)
            raise DamagedRecords(path, line, f"{key!r} is {value!r}, expected {kind}"
                                 f"{' or null' if nullable else ''}", SUMMARY_FIX, what="summary")
    return summary_as_today(summary)


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
