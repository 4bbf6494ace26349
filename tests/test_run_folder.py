"""The run folder has one owner (normgeo.run_folder): each of its names is defined there once, no other module
defines one again, joins a path with one or writes one out in a path, and the scheduled checkpoint's name
round-trips through its one format/parse pair. A message's prose (text with spaces) may name a file: models/
sits below normgeo and cannot import the names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import normgeo.run_folder as run_folder
from normgeo.run_folder import RunFolder, checkpoint_name, checkpoint_step
from tests.conftest import ROOT

OWNER = ROOT / "normgeo" / "run_folder.py"
# Every name the owner defines, and the parts of the Hydra files' names.
NAMES = {value for key, value in vars(run_folder).items() if key.isupper() and isinstance(value, str)}
NAMES |= {part for value in run_folder.HYDRA_FILES for part in value.split("/")}
# A name only a file can have (an extension, or a leading dot): in a path anywhere but the owner, a copy.
FILE_NAMES = {name for name in NAMES if "." in name}
# A scheduled checkpoint's name written out: step-0000100.ckpt, step-*.ckpt, f"step-{step:07d}.ckpt"
CHECKPOINT_SPELLING = re.compile(r"step-\S*\.ckpt")
NOT_A_RUN = {"docs/figures"}  # the docs' own figures folder, not a run's


def python_files() -> list[Path]:
    """The non-test Python of the tree (bench/ and docs/ included), but the owner."""
    skipped = {"tests", ".git", ".venv", "outputs"}
    return sorted(path for path in ROOT.rglob("*.py")
                  if path != OWNER and not skipped & set(path.relative_to(ROOT).parts))


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def text_of(node: ast.AST) -> str | None:
    """A string constant's text; an f-string's with each replacement field as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(text_of(part) or "{}" for part in node.values)
    return None


def copies(source: str, name: str = "<string>") -> list[str]:
    """Where ``source`` defines one of the run folder's names, joins a path with one, or writes one in a
    path (a string without spaces: ``"copy/angles.jsonl"``, ``"*/summary.json"``): file:line: what."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    inside = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                text = text_of(side)
                if text is not None and text not in NOT_A_RUN and NAMES & set(text.split("/")):
                    found.append(f"{name}:{node.lineno}: joins {text!r}")
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and text_of(node.value) in NAMES:
            found.append(f"{name}:{node.lineno}: defines {text_of(node.value)!r} again")
        text = text_of(node)
        if text in NOT_A_RUN:
            continue
        if text is None or id(node) in skip or id(node) in inside or re.search(r"\s", text):
            continue
        parts = set(text.split("/"))
        if FILE_NAMES & parts or CHECKPOINT_SPELLING.search(text) or ("/" in text and NAMES & parts):
            found.append(f"{name}:{node.lineno}: writes {text!r}")
    return found


def test_each_run_folder_name_is_defined_once_and_nowhere_spelt_out() -> None:
    found = [line for path in python_files()
             for line in copies(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("source", [
    'run_dir / "checkpoints"',
    'SUMMARY = "summary.json"',
    'LOGS = "csv"',
    'path = f"{run_dir}/checkpoints/step-{step:07d}.ckpt"',
    'glob("step-*.ckpt")',
    'damage = ("trunc", "copy/csv/version_0/metrics.csv")',
])
def test_the_scan_sees_a_copy(source: str) -> None:
    assert copies(source)


def test_the_checkpoint_name_round_trips_through_its_one_pair() -> None:
    for step in (0, 1, 99, 1234567, 12345678):
        assert checkpoint_step(checkpoint_name(step)) == step
    assert checkpoint_name(100) == "step-0000100.ckpt"  # the name on disk stays what runs hold
    others = ("last.ckpt", "step-.ckpt", "step-12.ckpt.tmp", "step-x.ckpt")
    assert [checkpoint_step(name) for name in others] == [None] * 4


def test_a_run_folder_lists_its_scheduled_checkpoints_by_step(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    assert folder.scheduled_checkpoints() == {}
    folder.checkpoints.mkdir()
    for step in (20, 3, 100):
        folder.checkpoint(step).write_bytes(b"")
    folder.last_checkpoint.write_bytes(b"")
    (folder.checkpoints / "notes.txt").write_text("")
    assert folder.scheduled_checkpoints() == {step: folder.checkpoint(step) for step in (3, 20, 100)}
    with pytest.raises(ValueError, match="not one of the probe's records"):
        folder.record("notes.jsonl")
