"""The one way the command-line tools print a table: rich's, whatever the terminal."""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence

from rich.console import Console
from rich.table import Table


def print_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    left: Collection[str] = (),
    file=None,
    width: int | None = None,
) -> None:
    """Print ``rows`` under ``header``; the columns named in ``left`` are left-aligned, the others right.

    ``width``: the console's columns (default: the terminal's; 160 when piped). A table wider than that
    folds its header and text cells onto more lines; a right-aligned (number) cell is never cut or folded.
    """
    table = Table(title=title)
    for index, name in enumerate(header):
        number = name not in left
        # rich's default shortens a squeezed cell to "89… ± 1.…": fold text instead, and keep each
        # number column at least as wide as its widest cell so that numbers are printed whole.
        widest = max((len(row[index]) for row in rows), default=0)
        table.add_column(name, justify="right" if number else "left", overflow="fold",
                         min_width=widest if number else None)
    for row in rows:
        table.add_row(*row)
    out = file or sys.stdout
    # Piped output (logs, CI) gets rich's default 80 columns, which would wrap every cell.
    Console(file=out, width=width or (None if out.isatty() else 160)).print(table)
