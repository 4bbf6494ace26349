"""Each folder means one thing and imports run one way, down the floors; the README lists every module."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT, SHARED_FIXTURE_FILES, SHARED_FIXTURE_OF_GROUP

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
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__main__.py":  # a command-line entry point sits on top, like train.py
                continue
            upward += [
                f"{path.relative_to(ROOT)} -> {up}"
                for up in imported_packages(path)
                if FLOORS.index(up) > level
            ]
    assert upward == []


def layout_rows() -> dict[str, str]:
    """The README's ``## Layout`` table: the first cell (a folder like ``normgeo/runs/`` or a file) -> the
    row."""
    readme = ROOT.joinpath("README.md").read_text()
    layout = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in layout.splitlines():
        if line.startswith("| `"):
            first, rest = line[3:].split("`", 1)
            rows[first] = rest
    return rows


def test_the_readme_layout_table_names_every_module() -> None:
    """Every module, subpackages included, is named in the row of its own
    folder (``normgeo/figures/compare.py`` in the ``normgeo/figures/``
    row, ``normgeo/compare.py`` in the ``normgeo/`` row)."""
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


# Inside normgeo, the same rule between its subpackages; the command modules (normgeo/<name>.py) sit on top,
# normgeo/paths.py (names and folders) and normgeo/run_folder.py (a run folder's names), the standard library
# only, at the bottom.
NORMGEO_FLOORS = (
    "normgeo.paths",
    "normgeo.run_folder",
    "normgeo.signals",
    "normgeo.measure",
    "normgeo.config",
    "normgeo.runs",
    "normgeo.readers",
    "normgeo.verdict",
    "normgeo.figures",
)
OWN_PACKAGES = ("corpus", "models", "normgeo", "callbacks", "slurm")


def module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_modules() -> dict[str, object]:
    paths = [p for package in OWN_PACKAGES for p in (ROOT / package).rglob("*.py")]
    return {module_name(p): p for p in [*paths, ROOT / "train.py", ROOT / "analyze.py"]}


def imports_of(path, modules) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import in the file, those inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append((submodule, None) if submodule in modules else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
    return [(module, name) for module, name in found if module in modules]


def import_graph() -> dict[str, set[str]]:
    modules = own_modules()
    return {name: {m for m, _ in imports_of(path, modules) if m != name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_between_modules_also_inside_functions() -> None:
    assert cycles(import_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_underscore_name_is_imported_from_another_module() -> None:
    modules = own_modules()
    private = [
        f"{name} imports {module}.{imported}"
        for name, path in modules.items()
        for module, imported in imports_of(path, modules)
        if imported is not None and imported.startswith("_") and module != name
    ]
    assert private == []


def test_normgeo_subpackages_import_down_their_floors() -> None:
    def floor(module: str) -> int | None:
        return next(
            (i for i, f in enumerate(NORMGEO_FLOORS) if module == f or module.startswith(f"{f}.")), None
        )

    upward = [
        f"{name} -> {imported}"
        for name, imported_modules in import_graph().items()
        if floor(name) is not None
        for imported in imported_modules
        if imported.startswith("normgeo.") and (floor(imported) is None or floor(imported) > floor(name))
    ]
    assert upward == []


def test_the_files_sharing_a_session_fixture_are_scheduled_together() -> None:
    """conftest.SHARED_FIXTURE_FILES names exactly the test files that use each shared session fixture."""
    for group, fixtures in SHARED_FIXTURE_OF_GROUP.items():
        users = {path.name for path in (ROOT / "tests").glob("test_*.py")
                 if any(re.search(rf"\b{fixture}\b", path.read_text()) for fixture in fixtures)}
        assert users == set(SHARED_FIXTURE_FILES[group]), group
