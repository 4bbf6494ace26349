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


def test_the_readme_layout_table_names_every_module() -> None:
    readme = ROOT.joinpath("README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = [
        f"{package}/{path.name}"
        for package in (*FLOORS, "slurm", "bench")
        for path in sorted((ROOT / package).glob("*.py"))
        if path.name != "__init__.py" and f"`{path.name}`" not in layout
    ]
    assert missing == []
