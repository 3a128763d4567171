"""One run per run directory: an exclusive ``flock`` on ``run.dir/run.lock``.

The lock file holds the holder's PID, host and start time. The kernel drops a ``flock`` when
its holder dies however it dies (SIGKILL included), so a lock file that can be locked again is
stale: it is named in a warning and taken over. One process per launch holds it
(cli/train.py's ``holding_run_dir``): ``meshforge train`` itself, or ``--nproc N``'s launcher
before any rank starts and across elastic restarts (its ranks never lock), or under plain
torchrun rank 0 (a restarted rank 0 takes it over from its dead predecessor). The pre-flight
only looks (``refuse_if_held``), so that a busy run.dir is refused before anything else is said
of it.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any

from meshforge.errors import MeshforgeError

LOCK_NAME = "run.lock"


class RunDirLocked(MeshforgeError):
    """Another live process holds run.dir's lock."""


class RunLock:
    """A held lock; ``release()`` (or process exit) lets it go."""

    def __init__(self, path: Path, fd: int, stale: dict[str, Any] | None) -> None:
        self.path, self.fd, self.stale = path, fd, stale

    def release(self) -> None:
        if self.fd < 0:
            return
        _HELD.pop(str(self.path), None)
        try:
            if os.lstat(self.path).st_ino == os.fstat(self.fd).st_ino:  # ours still, not a file put in its place
                self.path.unlink()  # unlink first: a waiter then sees a new file, not ours
        except OSError:
            pass
        os.close(self.fd)  # drops the flock
        self.fd = -1


_HELD: dict[str, RunLock] = {}


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "a process that left no details"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"PID {info.get('pid')} on {info.get('host')} (started {started})"


def _read(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None


def lock_path(run_dir: Path) -> Path:
    """run.dir's lock file: the directory resolved, the file itself not (it is never followed)."""
    return Path(run_dir).resolve() / LOCK_NAME


def _open(path: Path) -> int:
    """Open (create) the lock file, refusing a symbolic link there: written to and removed, a link
    would truncate and delete whatever file it points at."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise RunDirLocked(
            f"{path} is a symbolic link (to {os.readlink(path)}), not meshforge's lock file; meshforge does not "
            "follow it (it would overwrite and remove what it points at): remove the link, or choose another run.dir"
        ) from None


def acquire(run_dir: Path) -> RunLock | None:
    """Lock ``run_dir`` (which must exist) for this process. None when this process holds it
    already. Raises RunDirLocked naming the holder."""
    path = lock_path(run_dir)
    if str(path) in _HELD:
        return None
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            info = _read(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _in_use(run_dir, path, info) from None
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as we locked it: lock the new one
    stale = _read(fd)
    if os.fstat(fd).st_size and not (isinstance(stale, dict) and "pid" in stale):
        os.close(fd)  # someone's own file named run.lock: never truncated, written or removed
        raise RunDirLocked(
            f"{path} is not meshforge's lock file (it holds something else); meshforge does not write over it: "
            "move it away, or choose another run.dir"
        )
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv[:8]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
    lock = RunLock(path, fd, stale)
    _HELD[str(path)] = lock
    atexit.register(lock.release)  # a clean exit leaves no lock file (a killed holder leaves a stale one)
    return lock


def _in_use(run_dir: Path, path: Path, info: dict[str, Any] | None) -> RunDirLocked:
    return RunDirLocked(
        f"run.dir = {run_dir} is in use by another meshforge run: {_describe(info)} holds {path}. "
        "Wait for it to finish (or stop it), or choose another run.dir"
    )


def refuse_if_held(run_dir: Path) -> None:
    """Raise RunDirLocked when a live process holds ``run_dir``'s lock. A look only: nothing is
    created or written (no lock file, no link followed); a missing run.dir or lock file is free."""
    path = lock_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return  # none there (or a link, or unreadable: taking the lock says what is wrong with it)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # dropped when fd closes
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _in_use(run_dir, path, _read(fd)) from None
    finally:
        os.close(fd)


def stale_note(lock: RunLock | None) -> str | None:
    """The warning for a lock taken over from a process that died holding it, else None."""
    if lock is None or not lock.stale or lock.stale.get("pid") == os.getpid():
        return None
    return (
        f"run.dir {lock.path.parent}: took over a stale lock left by {_describe(lock.stale)}, which is no longer "
        "running (it ended without releasing it: killed or crashed)"
    )


def hold(run_dir: Path, quiet: bool = False) -> RunLock | None:
    """``acquire`` and say (on stderr) when a stale lock was taken over."""
    try:
        lock = acquire(run_dir)
    except OSError as e:  # a read-only run.dir, no permission: said as the write probe says it
        from meshforge.guards.disk import DiskError, describe

        raise DiskError(describe(run_dir, e, "write run.dir at")) from None
    note = stale_note(lock)
    if note and not quiet:
        print(f"meshforge: warning: {note}", file=sys.stderr)
    return lock
