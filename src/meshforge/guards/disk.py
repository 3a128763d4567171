"""Disk errors a user can cause, said once, as one ``meshforge: error:`` paragraph.

A read-only or full filesystem, missing permissions or a file where a directory should be are
known before training when run.dir is probed (``probe_run_dir``: write, fsync and remove a file)
and its free space is held against one checkpoint's size (``check_free_space``: the planner's
state bytes for this model). Whatever still fails later (the disk fills mid-run) is turned
into a ``DiskError`` by ``disk_error`` from the exception chain (PyTorch's distributed
checkpoint wraps each rank's OSError in a CheckpointException).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from meshforge.errors import MeshforgeError

FIXES = {
    errno.EROFS: "the filesystem is mounted read-only; choose a run.dir on a writable filesystem",
    errno.EACCES: "this user may not write there; choose another run.dir or change the directory's permissions",
    errno.EPERM: "this user may not write there; choose another run.dir or change the directory's permissions",
    errno.ENOSPC: "the disk is full; free space there (old runs, checkpoint.keep) or choose a run.dir on a larger disk",
    errno.EDQUOT: "the disk quota is used up; free space or choose a run.dir elsewhere",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another run.dir or move that file",
    errno.EEXIST: "a file is in the way of a directory; choose another run.dir or move that file",
    errno.EISDIR: "a directory is where a file should be; choose another run.dir",
    errno.ENAMETOOLONG: "the path is too long; choose a shorter run.dir",
    errno.EIO: "the device reported an I/O error; check the disk (dmesg) or choose another run.dir",
}
USER_ERRNOS = frozenset(FIXES)


class DiskError(MeshforgeError):
    """A filesystem refused a write the run needs (the CLI prints it and exits 2)."""


def describe(path: Path | str, err: OSError, doing: str = "write to", key: str = "run.dir") -> str:
    """One paragraph: what failed, on which path, the errno's meaning, and the fix (``key``: the
    setting or flag that names the path, e.g. --out)."""
    code = err.errno or 0
    name = errno.errorcode.get(code, str(code))
    where = err.filename or path
    fix = FIXES.get(code, "check the path and the filesystem, or choose another run.dir").replace("run.dir", key)
    return f"cannot {doing} {where}: {os.strerror(code)} ({name}); {fix}"


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where run.dir will be created)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_name_length(path: Path, key: str = "run.dir") -> None:
    """Refuse (ENAMETOOLONG) a path with a name longer than its filesystem allows, or too long as
    a whole, before anything looks it up (``Path.exists`` raises on such a name)."""
    if "\x00" in str(path):
        raise DiskError(f"{key} = {str(path)!r} holds a NUL character, which no filesystem allows; choose a plain name")
    path = Path(path).absolute()
    where = Path(path.anchor)
    for part in path.parts[1:]:  # the deepest part that exists, looked up one name at a time
        try:
            os.stat(where / part)
        except OSError:
            break
        where = where / part
    try:
        name_max, path_max = os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    longest = max((len(os.fsencode(p)) for p in path.parts), default=0)
    size = len(os.fsencode(str(path)))
    if longest > name_max or size >= path_max:
        sep = " " if key.startswith("-") else " = "  # --out PATH, run.dir = PATH
        what = f"a name of {longest} bytes (at most {name_max})" if longest > name_max else f"{size} bytes in all"
        raise DiskError(
            f"{key}{sep}{str(path)[:80]}... is too long for its filesystem ({what}): {os.strerror(errno.ENAMETOOLONG)} "
            f"(ENAMETOOLONG); choose a shorter {key}"
        )


def probe_run_dir(run_dir: Path, key: str = "run.dir") -> Path:
    """Write, fsync and remove a probe file in run.dir (or, before it exists, in the directory
    it will be created in), leaving nothing behind; returns where it probed. Raises DiskError
    (``key``: what names the path: run.dir, --out ...)."""
    run_dir = Path(run_dir)
    where = existing_ancestor(run_dir)
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(where))
        fd, probe = tempfile.mkstemp(prefix=".meshforge-write-probe-", dir=where)  # O_EXCL: follows no link
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"meshforge write probe\n")
                f.flush()
                os.fsync(f.fileno())
        finally:
            Path(probe).unlink(missing_ok=True)
    except OSError as e:
        e.filename = str(where)  # the directory, not the probe's random name
        raise DiskError(describe(run_dir, e, f"write {key} at", key)) from None
    return where


def check_disk(plan: Any) -> None:
    """Before training: run.dir is writable and has room for one checkpoint and the final weights
    (``plan``: the run plan, or a config: the same sections)."""
    probe_run_dir(Path(plan.run.dir))
    need, parts = 0, []
    if plan.checkpoint.interval != 0 or plan.checkpoint.final:
        need += checkpoint_bytes(plan.shape, plan.train.precision)
        parts.append("one checkpoint")
    finals = int(plan.checkpoint.save_final) + int(plan.checkpoint.export_hf)
    if finals:
        need += finals * 4 * plan.shape.num_params()
        parts.append("the final weights")
    if need:
        check_free_space(Path(plan.run.dir), need, " and ".join(parts) + " of this model")


def checkpoint_bytes(shape: Any, precision: str) -> int:
    """One checkpoint of this model: its parameters and optimizer state as the planner counts
    them (planner/memory.py's model_state_bytes on one GPU; gradients are not saved)."""
    from meshforge.planner.memory import model_state_bytes

    psi = shape.num_params()
    states = model_state_bytes(psi, 1, 0, "fp32" if precision == "fp32" else "bf16")
    return int(states["params"] + states["optimizer"])


def check_free_space(run_dir: Path, need: int, what: str) -> None:
    """Refuse (DiskError, ENOSPC) when run.dir's filesystem has less than ``need`` bytes free."""
    free = shutil.disk_usage(existing_ancestor(run_dir)).free
    if free < need:
        raise DiskError(
            f"run.dir = {run_dir} has {free / 2**20:,.1f} MiB free on its filesystem, less than {what} needs "
            f"({need / 2**20:,.1f} MiB): it would fail with {os.strerror(errno.ENOSPC)} (ENOSPC); free space there "
            "(old runs, checkpoint.keep) or choose a run.dir on a larger disk"
        )


def disk_error(exc: BaseException, run_dir: Path, need: int = 0) -> DiskError | None:
    """The DiskError an exception stands for (a user-fixable errno somewhere inside), else None.
    ``need``: the bytes the failed write wanted (one checkpoint): a short write with less room
    than that left is a full disk, even once another rank has freed its partial save."""
    chain = _chain(exc)
    found = _found(chain, run_dir, need)
    if found is not None:
        found.every_rank = any(isinstance(getattr(e, "failures", None), dict) for e in chain)  # DCP gathered it
    return found


def _found(chain: list[BaseException], run_dir: Path, need: int) -> DiskError | None:
    for e in chain:
        if isinstance(e, OSError) and e.errno in USER_ERRNOS:
            return DiskError(describe(run_dir, e, "write"))
    text = " ".join(str(x) for x in chain)
    m = re.search(r"\[Errno (\d+)\]", text)  # an error flattened to text by a thread or a gather
    code = int(m.group(1)) if m and int(m.group(1)) in USER_ERRNOS else None
    if code is None and SHORT_WRITE.search(text):  # torch.save's zip writer: a short write, no errno
        code = errno.ENOSPC if _nearly_full(run_dir, need) else errno.EIO
    if code is None:
        return None
    return DiskError(describe(run_dir, OSError(code, os.strerror(code), str(run_dir)), "write"))


SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed|file write failed")


def _chain(exc: BaseException | None) -> list[BaseException]:
    """``exc``, its causes and contexts, and a CheckpointException's per-rank failures (and theirs)."""
    out: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is x for x in out):
            continue
        out.append(e)
        failures = getattr(e, "failures", None)
        for inner in failures.values() if isinstance(failures, dict) else ():
            todo.append(inner[0] if isinstance(inner, tuple) else inner)  # DCP wraps (exception, traceback)
        todo += [e.__cause__, e.__context__]
    return out


def _nearly_full(run_dir: Path, need: int = 0) -> bool:
    """Whether run.dir's filesystem is (all but) full: under 1 MiB, 0.1% or ``need`` bytes left."""
    try:
        u = shutil.disk_usage(existing_ancestor(run_dir))
    except OSError:
        return False
    return u.free < max(2**20, u.total // 1000, need)
