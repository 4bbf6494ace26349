"""Atomic file writes: a reader (or a restarted job) sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# Every temporary file of this project ends so: a run or a prepare can find and remove the ones a killed
# process left behind (a 1b last.ckpt temporary is ~12 GB).
TMP_SUFFIX = ".normgeo-tmp"
FULL_DISK = {errno.ENOSPC, errno.EDQUOT}


class DiskFullError(OSError):
    """A write that found its disk full (or its quota used up), naming the file it was writing.

    The real cause is otherwise hard to see: torch.save reports a full disk as an unrelated
    ``RuntimeError: [enforce fail at inline_container.cc:...]`` raised while handling the OSError, and
    an OSError from ``write`` names no file.
    """

    def __init__(self, path: str | os.PathLike, cause: OSError | None = None) -> None:
        code = cause.errno if cause is not None and cause.errno in FULL_DISK else errno.ENOSPC
        super().__init__(code, os.strerror(code), os.fspath(path))

    def __str__(self) -> str:
        return f"{self.strerror} writing {self.filename}"


def full_disk_cause(err: BaseException | None) -> OSError | None:
    """The OSError of a full disk behind ``err``: ``err`` itself or one it was raised from or while handling
    (a DiskFullError first: it names the file), else None."""
    found: OSError | None = None
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DiskFullError):
            return err
        if found is None and isinstance(err, OSError) and err.errno in FULL_DISK:
            found = err
        err = err.__cause__ or err.__context__
    return found


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """Write to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    path = Path(path)
    # Named before it exists, so that a signal landing as the file is created (a second Ctrl-C) still finds
    # the name to remove; mkstemp returns it only once the file is there.
    tmp_name = str(path.parent / f".{path.name}.{secrets.token_hex(8)}{TMP_SUFFIX}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp_name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, usual_file_mode())  # private while written; then the usual mode
        os.replace(tmp_name, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)  # frees the space a full disk's partial file took
        cause = full_disk_cause(err)
        if cause is not None and not isinstance(cause, DiskFullError):
            # One error that names the file, whatever wrapped the OSError (torch.save's RuntimeError).
            raise DiskFullError(path, cause) from err
        raise


def temporary_path(path: str | os.PathLike) -> Path:
    """The fixed temporary name beside ``path`` for a writer that holds a lock (corpus preparation)."""
    path = Path(path)
    return path.parent / f".{path.name}{TMP_SUFFIX}"


def remove_stale_temporaries(folder: str | os.PathLike) -> tuple[int, int]:
    """Delete the temporaries a killed writer left under ``folder``; returns (files, bytes) removed.

    Only for a folder no other process is writing into at the same time (the caller holds it).
    """
    count = size = 0
    for stale in Path(folder).rglob(f"*{TMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            bytes_ = stale.stat().st_size
            stale.unlink()
            count, size = count + 1, size + bytes_
    return count, size


def usual_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the umask (0644 under the usual 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def give_usual_file_modes(folder: Path) -> None:
    """Every file under ``folder`` readable as the user's other files are: libraries that write through
    private temporaries (safetensors) leave 0600 files."""
    mode = usual_file_mode()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
