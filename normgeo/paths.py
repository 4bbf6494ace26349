"""Names and folders: the one file-name slug, paths a
generated page may show, and folders an entry point creates.

Shared by the run's start (normgeo.runs), analyze.py, the figures and the readers (compare, report), so that
none of them imports another's machinery for a name or a folder check: normgeo's lowest floor, the standard
library only (tests/test_layout.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path

from corpus.refusal import Refusal

REPO_ROOT = Path(__file__).resolve().parents[1]
# An absolute path in a generated page: a "/" not inside
# a word, a number or a URL ("https://"), then no space.
ABSOLUTE_PATH = re.compile(r"(?<![\w./])/(?!/)[^\s,;)'\"`]+")


class FolderError(Refusal, ValueError):
    """A folder an entry point must write into cannot be created or written there; one line, with the key."""


def repo_relative(text: str, root: Path = REPO_ROOT) -> str:
    """``text`` with every absolute path on this machine written relative to the repository
    (``../shared/...``), so that a generated page's commands and sources run from any checkout."""

    def relative(match: re.Match[str]) -> str:
        path = match.group(0)
        top = Path("/", Path(path).parts[1]) if len(Path(path).parts) > 1 else None
        return os.path.relpath(path, root) if top is not None and top.exists() else path

    return ABSOLUTE_PATH.sub(relative, text)


def slug(name: object, empty: str = "unnamed") -> str:
    """The one file/folder-name rule for a model name, Hub id or path: a Hub id's ``/`` becomes ``--``
    (the Hub cache's convention), every run of other characters than ``A-Za-z0-9._-`` one ``-``.

    ``EleutherAI/pythia-1.4b`` -> ``EleutherAI--pythia-1.4b``; independent of the working directory.
    """
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name or "").replace("/", "--"))
    return text.strip("-.") or empty


def path_slug(value: str) -> str:
    """A readable, collision-safe folder name for a path: 'webtext-1a2b3c4d' (its slug and a hash)."""
    text = str(value)
    stem = slug(Path(text.rstrip("/*")).name, empty="root")
    return f"{stem}-{hashlib.sha256(os.path.abspath(text).encode()).hexdigest()[:8]}"


def check_writable_folder(folder: Path, key: str) -> None:
    """``folder`` exists as a writable directory or can be created: FolderError naming what is in the way."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "a file" if existing.is_file() else "not a folder"
        raise FolderError(f"{key}={folder}: {existing} is {what}, so the folder cannot be created there; "
                          f"choose another {key}=...")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FolderError(f"{key}={folder}: {existing} is not writable (permissions or a read-only "
                          f"filesystem); choose another {key}=...")


def folder_owner(folder: Path, markers: Mapping[str, str]) -> tuple[Path, str] | None:
    """The nearest of ``folder`` (resolved) and its parents holding one of ``markers`` (file name -> what it
    marks), with that marker's name: the command whose folder ``folder`` is, or lies in (None: none)."""
    resolved = folder.resolve()
    for candidate in (resolved, *resolved.parents):
        name = next((name for name in markers if (candidate / name).is_file()), None)
        if name is not None:
            return candidate, name
    return None


def check_own_folder(folder: Path, key: str, markers: Mapping[str, str], own: str | None,
                     own_subfolders: Collection[str] = (), beside: str = "out",
                     owners: Collection[Path] = ()) -> None:
    """``folder`` may take this command's outputs: FolderError when it is the filesystem's root; is, or lies
    at any depth below, a folder holding another command's outputs (one of ``markers``, file name -> what it
    marks; a folder marked by this command's ``own`` is its own, to write again, but nothing goes below it);
    or holds a sweep (a visible folder one level down holding a marker): a command writes only where it owns.
    ``own_subfolders`` are the folders this command keeps inside the folders ``owners`` (report's ``figures``
    inside the runs it draws, not another run's); ``beside`` names the folder the refusal suggests beside the
    owner's."""
    resolved = folder.resolve()
    if resolved == Path(resolved.anchor):
        raise FolderError(f"{key}={folder}: the filesystem's root (an unset variable in the path?); choose a "
                          f"folder of its own, e.g. {key}=outputs/...")
    if (owned := folder_owner(resolved, markers)) is not None:
        owner, name = owned
        inside = resolved.relative_to(owner).parts
        if owner == resolved and name != own:
            raise FolderError(f"{key}={folder} holds {markers[name]}: nothing of this command goes there; "
                              f"choose another {key}=...")
        kept = bool(inside) and inside[0] in own_subfolders and owner in {Path(o).resolve() for o in owners}
        if owner != resolved and not kept:
            raise FolderError(f"{key}={folder} is inside {owner}, which holds {markers[name]}: nothing of "
                              f"this command goes there; write it beside that folder, e.g. "
                              f"{key}={owner.parent / f'{owner.name}-{beside}'}")
    if not resolved.is_dir():
        return
    runs = sorted(child.name for child in resolved.iterdir()
                  if child.is_dir() and not child.name.startswith(".")
                  and any((child / name).is_file() for name in markers))
    if runs:
        listed = ", ".join(runs[:3]) + (", ..." if len(runs) > 3 else "")
        raise FolderError(f"{key}={folder} holds a sweep ({len(runs)} run(s): {listed}): choose a folder "
                          f"of its own, e.g. {key}={folder}/<name>")


def topmost_missing(path: Path) -> Path | None:
    """The topmost of ``path`` and its parents that does not exist: what ``mkdir(parents=True)`` would create
    first (None: ``path`` exists)."""
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def remove_created(path: Path, created: Path | None) -> None:
    """Undo ``mkdir(parents=True)`` of ``path`` whose topmost new folder was ``created``: ``path`` removed
    with its contents, then each parent it created while empty (something else may live there by now)."""
    if created is None:
        return
    shutil.rmtree(path, ignore_errors=True)
    folder = path.parent
    while folder == created or created in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
