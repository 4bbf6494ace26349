"""What the bench scripts share: their command line, refusals, timing and markdown tables."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser, its module docstring (examples included) as the help."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def refused(script: str, message: str) -> int:
    """``bench/<script>: message`` on stderr, one line; the exit status of bad input."""
    print(f"bench/{script}: {message}", file=sys.stderr)
    return 2


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call_seconds(fn: Callable[[], object], number: int, device: torch.device) -> float:
    """Mean seconds per call over ``number`` back-to-back calls (CUDA: synchronized before and after)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / number


def rotated(items: Sequence[T], repeat: int) -> list[T]:
    """``items`` started ``repeat`` places on: interleaved repeats rotate their order, so that no item always
    runs first."""
    shift = repeat % len(items)
    return [*items[shift:], *items[:shift]]


def utc_stamp() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table: the header, its rule, one line per row."""
    lines = (header, ["---"] * len(header), *rows)
    return "\n".join(f"| {' | '.join(str(cell) for cell in row)} |" for row in lines)
