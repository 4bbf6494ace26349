"""One training process per run directory: an exclusive ``flock`` (filelock's UnixFileLock) on
``<run_dir>/.normgeo.lock``.

Two ``train.py`` started into the same run directory would both train it, interleave ``train.log`` and
write two CSV versions. The second one is refused instead, naming the holder's host and PID (the file's
content, JSON, written once the lock is held; filelock opens the file without truncating it). The kernel
drops a ``flock`` when its process dies (SIGKILL, a requeued or cancelled SLURM job), so a killed run never
leaves its directory locked. The file is created when a start claims the directory (normgeo.runs.start)
and stays, hidden, afterwards: deleting a lock file races with a process that opened it just before. Only
the launching process (global rank 0) holds it; the processes Lightning's DDP launcher starts share its run.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from pathlib import Path

from filelock import Timeout, UnixFileLock

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
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():  # a new run, one from before locks, or no run directory at all
        return None
    probe = UnixFileLock(path, timeout=0, thread_local=False, fallback_to_soft=False)
    try:
        probe.acquire()
    except Timeout:
        return _holder_text(path.read_text(errors="replace"))
    except OSError:  # a filesystem without locks: nothing to learn here
        return None
    probe.release()
    return None


class RunLock:
    """The exclusive lock of one run directory, held from :meth:`acquire` until :meth:`release` or exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        # one holder per process (not per thread); no soft lock where flock is missing (acquire warns)
        self.lock = UnixFileLock(self.path, thread_local=False, fallback_to_soft=False)

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock (waiting up to ``wait_s``) and record this host and PID; RunInUseError if held."""
        try:
            self.lock.acquire(timeout=max(wait_s, _PROBE_GRACE_S))
        except Timeout:
            holder = _holder_text(self.path.read_text(errors="replace"))
            raise RunInUseError(in_use_message(self.run_dir, holder)) from None
        except OSError as err:  # e.g. Lustre mounted without -o flock: run, but say it is unguarded
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            log.warning("%s: the filesystem refuses file locks (%s); nothing stops a second train.py "
                        "from starting into this run directory", self.path, err)
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.path.write_text(json.dumps(holder) + "\n")

    def release(self) -> None:
        if self.lock.is_locked:
            self.lock.release()
