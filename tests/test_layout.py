"""Each folder means one thing and imports run one way, down the floors; docs/architecture.md names every
module, and every module and definition it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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


ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The tree's modules and scripts, each named in its folder's row of the layout table.
NAMED_FOLDERS = (*FLOORS, "slurm", "bench", "docs")
SCRIPT_SUFFIXES = (".py", ".sh", ".sbatch")
FILE_NAME = re.compile(r"`([\w./-]+(?:\.py|\.sh|\.sbatch))`")
# ``path.py:Name`` or ``path.py:Class.method``: a definition the page walks through.
DEFINITION = re.compile(r"`([\w/]+\.py):([A-Za-z_][\w.]*)`")


def layout_rows(text: str | None = None) -> dict[str, str]:
    """docs/architecture.md's ``## Layout`` table: the first cell (a folder like ``normgeo/runs/`` or a file)
    -> the row."""
    text = ARCHITECTURE.read_text() if text is None else text
    layout = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in layout.splitlines():
        if line.startswith("| `"):
            first, rest = line[3:].split("`", 1)
            rows[first] = rest
    return rows


def tree_modules() -> list[Path]:
    """Every module and script the layout must name: the top-level entry points, and the files (subpackages
    included) of the named folders; a package's ``__init__.py`` is named by its folder."""
    found = [*sorted(ROOT.glob("*.py"))]
    for package in NAMED_FOLDERS:
        found += [path for path in sorted((ROOT / package).rglob("*"))
                  if path.suffix in SCRIPT_SUFFIXES and path.name != "__init__.py"]
    return found


def unnamed_modules(rows: dict[str, str]) -> list[str]:
    """The modules not named in the row of their folder (``normgeo/figures/arm_overlay.py`` in the
    ``normgeo/figures/`` row, ``normgeo/compare.py`` in the ``normgeo/`` row, ``train.py`` its own row); the
    subpackages of ``hydra_plugins/`` by their folder."""
    missing = []
    for path in tree_modules():
        relative = path.relative_to(ROOT)
        folder = relative.parent.as_posix()
        if folder == ".":
            if relative.name not in rows:
                missing.append(relative.name)
        elif f"`{path.name}`" not in rows.get(f"{folder}/", ""):
            missing.append(relative.as_posix())
    missing += [
        f"hydra_plugins/{plugin.name}/"
        for plugin in sorted((ROOT / "hydra_plugins").iterdir())
        if (plugin / "__init__.py").is_file() and f"`{plugin.name}/`" not in rows.get("hydra_plugins/", "")
    ]
    return missing


def named_but_missing(rows: dict[str, str]) -> list[str]:
    """The files a row names that do not exist: a bare name in the row's folder (or at the top, like
    ``train.py``), a name with a slash from the repository's root."""
    missing = []
    for first, row in rows.items():
        folder = ROOT / first if first.endswith("/") else ROOT
        if not first.endswith("/") and not (ROOT / first).exists():
            missing.append(first)
        for name in FILE_NAME.findall(row):
            if "/" in name:
                found = (ROOT / name).exists()
            else:
                found = (folder / name).exists() or (ROOT / name).exists()
            if not found:
                missing.append(f"{first}: {name}")
    return missing


def defined_names(path: Path) -> dict[str, set[str]]:
    """A module's top-level names -> the names defined in each (a class's methods and attributes)."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = set()
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        inner.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        inner.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        inner.update(t.id for t in item.targets if isinstance(t, ast.Name))
            names[node.name] = inner
        elif isinstance(node, ast.Assign):
            names.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()
    return names


def missing_definitions(text: str) -> list[str]:
    """The ``path.py:Name`` and ``path.py:Class.method`` references of ``text`` whose file or name is gone."""
    missing = []
    for file, qualname in DEFINITION.findall(text):
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file}:{qualname}: no such file")
            continue
        names = defined_names(path)
        top, _, inner = qualname.partition(".")
        if top not in names or (inner and inner not in names[top]):
            missing.append(f"{file}:{qualname}: not defined there")
    return missing


def missing_paths(text: str) -> list[str]:
    """The repository files ``text`` names by path (``normgeo/runs/start.py``, ``conf/train/train.yaml``) that
    do not exist."""
    named = re.findall(r"`([\w-]+(?:/[\w.-]+)+\.(?:py|sh|sbatch|yaml|md))(?::[\w.]+)?`", text)
    return sorted({path for path in named if not (ROOT / path).exists()})


def test_the_layout_names_every_module() -> None:
    assert unnamed_modules(layout_rows()) == []


def test_every_module_the_layout_names_exists() -> None:
    assert named_but_missing(layout_rows()) == []


def test_every_definition_and_path_the_architecture_page_names_exists() -> None:
    text = ARCHITECTURE.read_text()
    assert len(DEFINITION.findall(text)) >= 40, "the walks through the code lost their references"
    assert missing_definitions(text) == []
    assert missing_paths(text) == []


def test_every_path_the_readme_names_exists() -> None:
    assert missing_paths(ROOT.joinpath("README.md").read_text()) == []


def test_the_layout_checks_see_a_missing_module_both_ways() -> None:
    rows = layout_rows()
    assert "normgeo/measure/" in rows and "normgeo/runs/" in rows and "normgeo/figures/" in rows
    assert "`stats.py`" in rows["normgeo/measure/"] and "`stats.py`" not in rows["normgeo/runs/"]
    # a module left out of its row is found; a row naming a module that moved is found
    dropped = {**rows, "normgeo/measure/": rows["normgeo/measure/"].replace("`stats.py`", "`st.py`")}
    assert "normgeo/measure/stats.py" in unnamed_modules(dropped)
    assert "normgeo/measure/: st.py" in named_but_missing(dropped)
    moved = {**rows, "normgeo/readers/": rows["normgeo/readers/"] + " `records.py`"}
    assert named_but_missing(moved) == ["normgeo/readers/: records.py"]
    assert unnamed_modules({k: v for k, v in rows.items() if k != "train.py"}) == ["train.py"]


def test_the_definition_check_sees_a_renamed_function() -> None:
    assert missing_definitions("`models/lit.py:LitGPT.training_step` `corpus/stream.py:window_offsets`") == []
    assert missing_definitions("`models/lit.py:LitGPT.train_step` `models/lit.py:warmup`") == [
        "models/lit.py:LitGPT.train_step: not defined there", "models/lit.py:warmup: not defined there"]
    assert missing_definitions("`models/gone.py:GPT`") == ["models/gone.py:GPT: no such file"]
    moved = "`normgeo/readers/records.py` `conf/train/train.yaml`"
    assert missing_paths(moved) == ["normgeo/readers/records.py"]


# Inside normgeo, the same rule between its subpackages; the command modules (normgeo/<name>.py) sit on top,
# normgeo/paths.py (names and folders) and normgeo/run_folder.py (a run folder's names), the standard library
# only, at the bottom.
NORMGEO_FLOORS = (
    "normgeo.paths",
    "normgeo.run_folder",
    "normgeo.config.fields",  # how a key is declared (no normgeo imports): for every part that declares keys
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
