"""Each signal handler of a run puts back the one it replaced: train.py's start (checks, data preparation),
the training's stop (callbacks.signals.Interrupt, over Lightning's own), the end's (the summary, figures).
A caller's handlers (a notebook's, a test's, a sweep's next job's) are there again when train.py's main
returns. Before: the training's stop put back Python's defaults, and the start's stayed for good."""

from __future__ import annotations

import signal
from pathlib import Path

from callbacks.signals import Interrupt
from tests.conftest import train_here


def test_a_training_run_with_data_preparation_and_a_probe_leaves_the_callers_handlers(tmp_path: Path) -> None:
    seen: list[int] = []

    def caller(signum: int, frame: object) -> None:  # never called: the identity is what is checked
        seen.append(signum)

    before = {signum: signal.signal(signum, caller) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        run_dir = tmp_path / "run"
        train_here(run_dir, "max_steps=2", "checkpoint.steps=[2]")  # prepares tmp_path/data, probes
        assert (tmp_path / "data").is_dir() and (run_dir / "angles.jsonl").stat().st_size > 0
        assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == {
            signal.SIGINT: caller, signal.SIGTERM: caller
        }
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert seen == []


def test_the_training_stop_puts_back_the_handler_it_replaced() -> None:
    def outer(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, outer)
    try:
        interrupt = Interrupt()
        interrupt.install()
        assert signal.getsignal(signal.SIGTERM) is interrupt
        interrupt.uninstall()
        assert signal.getsignal(signal.SIGTERM) is outer
    finally:
        signal.signal(signal.SIGTERM, previous)
