"""Each folder means one thing and imports run one way, down the floors; the README lists every module."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

# Lowest first: a module may import from its own floor and the floors below, never above.
FLOORS = ("corpus", "models", "normgeo", "callbacks")


def imported_packages(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names & set(FLOORS)


def test_no_import_runs_back_up_a_floor() -> None:
    upward = []
    for level, package in enumerate(FLOORS):
        for path in sorted((ROOT / package).glob("*.py")):
            if path.name == "__main__.py":  # a command-line entry point sits on top, like train.py
                continue
            upward += [f"{package}/{path.name} -> {up}" for up in imported_packages(path) if FLOORS.index(up) > level]
    assert upward == []


def layout_rows() -> dict[str, str]:
    """The README's ``## Layout`` table: the first cell (a folder like ``normgeo/runs/`` or a file) -> the row."""
    readme = ROOT.joinpath("README.md").read_text()
    layout = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in layout.splitlines():
        if line.startswith("| `"):
            first, rest = line[3:].split("`", 1)
            rows[first] = rest
    return rows


def test_the_readme_layout_table_names_every_module() -> None:
    """Every module, subpackages included, is named in the row of its own folder (``normgeo/figures/compare.py``
    in the ``normgeo/figures/`` row, ``normgeo/compare.py`` in the ``normgeo/`` row)."""
    rows = layout_rows()
    missing = [
        str(path.relative_to(ROOT))
        for package in (*FLOORS, "slurm", "bench")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "__init__.py"
        and f"`{path.name}`" not in rows.get(f"{path.parent.relative_to(ROOT).as_posix()}/", "")
    ]
    assert missing == []


def test_the_layout_check_sees_a_missing_module() -> None:
    rows = layout_rows()
    assert "normgeo/measure/" in rows and "normgeo/runs/" in rows and "normgeo/figures/" in rows
    assert "`stats.py`" in rows["normgeo/measure/"] and "`stats.py`" not in rows["normgeo/runs/"]
