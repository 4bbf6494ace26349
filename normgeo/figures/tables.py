"""The one way the command-line tools print a table: rich's, whatever the terminal."""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence


def print_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    left: Collection[str] = (),
    file=None,
) -> None:
    """Print ``rows`` under ``header``; the columns named in ``left`` are left-aligned, the others right."""
    from rich.console import Console  # rich costs ~0.1 s to import: only when a table is printed
    from rich.table import Table

    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in left else "right")
    for row in rows:
        table.add_row(*row)
    out = file or sys.stdout
    # Piped output (logs, CI) gets rich's default 80 columns, which would wrap every cell.
    Console(file=out, width=None if out.isatty() else 160).print(table)
