"""One training process per run directory: a kernel lock (``flock``) on ``<run_dir>/.normgeo.lock``.

Two ``train.py`` started into the same run directory would both train it, interleave ``train.log`` and
write two CSV versions. The second one is refused instead, naming the holder's host and PID (the file's
content, JSON). The kernel drops a ``flock`` when its process dies (SIGKILL, a requeued or cancelled SLURM
job), so a killed run never leaves its directory locked. The file is created when a start claims the
directory (normgeo.runs.start) and stays, hidden, afterwards: deleting a lock file races with a process
that opened it just before. Only the launching process (global rank 0) holds it; the processes Lightning's
DDP launcher starts share its run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".normgeo.lock"
# A start that finds the lock held tries again for this long: a probe by another starting process
# (lock_holder) holds it for microseconds, and must not make this start fail.
_PROBE_GRACE_S = 1.0
log = logging.getLogger(__name__)


class RunInUseError(RuntimeError):
    """Another process trains this run directory; the message names its host and PID."""


def _holder_text(raw: str) -> str:
    try:
        holder = json.loads(raw)
        return f"PID {holder['pid']} on host {holder['host']} (since {holder['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process (the lock file names no holder)"


def in_use_message(run_dir: Path, holder: str) -> str:
    return (f"{run_dir} is being trained by {holder}: one process per run directory. Wait for that run to "
            "end (or stop it), or start this one under another run_name=...")


def lock_holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock ("PID 12 on host n1 (since ...)"), None when nobody does; writes
    nothing."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (a new run, or one from before locks), or no run directory at all
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts only with a holder's exclusive lock
        except BlockingIOError:
            return _holder_text(os.pread(fd, 4096, 0).decode(errors="replace"))
        except OSError:  # a filesystem without locks: nothing to learn here
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """The exclusive lock of one run directory, held from :meth:`acquire` until :meth:`release` or exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock (waiting up to ``wait_s``) and record this host and PID; RunInUseError if held."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # O_CLOEXEC: no child keeps it
        deadline = time.monotonic() + max(wait_s, _PROBE_GRACE_S)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _holder_text(os.pread(fd, 4096, 0).decode(errors="replace"))
                    os.close(fd)
                    raise RunInUseError(in_use_message(self.run_dir, holder)) from None
                time.sleep(0.05)
            except OSError as err:  # e.g. Lustre mounted without -o flock: run, but say it is unguarded
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                log.warning("%s: the filesystem refuses file locks (%s); nothing stops a second train.py "
                            "from starting into this run directory", self.path, err)
                break
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
