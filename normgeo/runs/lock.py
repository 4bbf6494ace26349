"""One training process per run directory: an exclusive ``flock`` (filelock's UnixFileLock) on
``<run_dir>/.normgeo.lock``, held by the launching process (global rank 0). A second ``train.py`` into the
same directory (it would interleave ``train.log``) is refused, naming the holder's host and PID (the file's
JSON; filelock does not truncate it). The kernel drops a ``flock`` when its process dies (SIGKILL, a
cancelled SLURM job), so a killed run never leaves its directory locked. The file stays afterwards:
deleting a lock file races with a process that just opened it.
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

from corpus.refusal import Refusal
from normgeo.run_folder import RunFolder

# A start that finds the lock held tries again for this long: a probe by another starting process
# (check_unlocked) holds it for microseconds, and must not make this start fail.
_PROBE_GRACE_S = 1.0
log = logging.getLogger(__name__)


class RunInUseError(Refusal, RuntimeError):
    """Another process trains this run directory; the message names its host and PID (the lock file's)."""

    def __init__(self, run_dir: Path) -> None:
        try:
            holder = json.loads(RunFolder(run_dir).lock.read_text(errors="replace"))
            who = f"PID {holder['pid']} on host {holder['host']} (since {holder['since']})"
        except (OSError, ValueError, KeyError, TypeError):
            who = "another process (the lock file names no holder)"
        super().__init__(f"{run_dir} is being trained by {who}: one process per run directory. Wait for that "
                         "run to end (or stop it), or start this one under another run_name=...")


def check_unlocked(run_dir: Path) -> None:
    """RunInUseError when another process holds ``run_dir``'s lock; writes nothing."""
    path = RunFolder(run_dir).lock
    if not path.is_file():  # a new run, no run directory, or one from before locks (normgeo.runs.formats)
        return
    try:
        with UnixFileLock(path, timeout=0, thread_local=False, fallback_to_soft=False):
            return
    except Timeout:
        raise RunInUseError(Path(run_dir)) from None
    except OSError:  # a filesystem without locks: nothing to learn here
        return


class RunLock:
    """The exclusive lock of one run directory, held from :meth:`acquire` until :meth:`release` or exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = RunFolder(run_dir).lock
        # one holder per process (not per thread); no soft lock where flock is missing (acquire warns)
        self.lock = UnixFileLock(self.path, thread_local=False, fallback_to_soft=False)

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock (waiting up to ``wait_s``) and record this host and PID; RunInUseError if held."""
        try:
            self.lock.acquire(timeout=max(wait_s, _PROBE_GRACE_S))
        except Timeout:
            raise RunInUseError(self.run_dir) from None
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
