"""Reading only regular files, and no more of them than declared.

A path a user hands meshforge may name a FIFO (a read waits for a writer forever), a device
(``/dev/zero`` never ends) or a socket, directly or through a symbolic link. Every file is
therefore opened without blocking (``O_NONBLOCK``: opening a FIFO does not wait), checked on
the open descriptor (``fstat``: a link swapped in after a check cannot slip past) and read up
to a cap: the size its manifest declares, or a documented limit for the manifests themselves.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import BinaryIO

from meshforge.errors import MeshforgeError

MAX_MANIFEST_BYTES = 64 << 20  # index.json, meta.json, rank files, config.json: KiB to a few MiB
MAX_TOKENIZER_BYTES = 512 << 20  # a tokenizer.json of a 256K vocabulary is ~35 MB
MAX_JSONL_BYTES = 4 << 30  # a run's metrics.jsonl or events.jsonl: ~300 bytes a step
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (a named pipe: reading it waits for a writer)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
    """What a file's mode says it is, in words ("a FIFO ...", "a character device", ...)."""
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def not_regular(path: Path | str, mode: int, fix: str) -> str:
    """The sentence that refuses ``path`` for being of ``mode``'s kind (``fix``: what to do)."""
    return f"{path} is not a regular file: it is {kind_of(mode)}, and meshforge reads only regular files; {fix}"


def open_regular(path: Path | str, error: type[MeshforgeError] = MeshforgeError, fix: str = "") -> BinaryIO:
    """``path`` opened for reading (links followed) once it is known to be a regular file: opened
    without waiting (a FIFO's open blocks until a writer comes), then checked on the descriptor."""
    fix = fix or "give a regular file"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(cannot_read(path, e, fix)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(not_regular(path, st.st_mode, fix))
        _blocking(fd)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _blocking(fd: int) -> None:
    """Reads of a regular file never wait anyway; the flag goes so that nothing downstream sees it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: there was no O_NONBLOCK either
        return
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~getattr(os, "O_NONBLOCK", 0))


def cannot_read(path: Path | str, e: OSError, fix: str) -> str:
    """One sentence for a file that could not be opened (a loop of links is named as one)."""
    if e.errno == errno.ELOOP:
        return f"cannot read {path}: it is a symbolic link that leads back to itself (a loop); {fix}"
    return f"cannot read {path}: {e.strerror or e}; {fix}"


def _read_upto(f: BinaryIO, limit: int) -> bytes:
    """At most ``limit`` bytes, in blocks: ``f.read(limit)`` allocates all of ``limit`` at once,
    which a process under a memory limit (RLIMIT_DATA, RLIMIT_AS) cannot do for a 4 GiB cap."""
    blocks, left = [], limit
    while left:
        block = f.read(min(left, 1 << 22))
        if not block:
            break
        blocks.append(block)
        left -= len(block)
    return b"".join(blocks)


def read_regular(
    path: Path | str, cap: int = MAX_MANIFEST_BYTES, error: type[MeshforgeError] = MeshforgeError, fix: str = ""
) -> bytes:
    """The bytes of the regular file ``path``, refused when it holds more than ``cap`` bytes."""
    with open_regular(path, error, fix) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise error(f"{path} is {size:,} bytes, more than the {cap:,} such a file may hold; {fix or 'check it'}")
        try:
            data = _read_upto(f, cap + 1)
        except OSError as e:
            raise error(cannot_read(path, e, fix or "check the file")) from None
    if len(data) > cap:  # grew while it was read
        raise error(f"{path} holds more than the {cap:,} bytes such a file may hold; {fix or 'check it'}")
    return data


def sha256_declared(path: Path | str, size: int, error: type[MeshforgeError], fix: str) -> str:
    """The sha256 of the regular file ``path``, which must hold exactly ``size`` bytes: no more is
    read than its manifest declares (a file that grows meanwhile is hashed no further)."""
    h = hashlib.sha256()
    with open_regular(path, error, fix) as f:
        have = os.fstat(f.fileno()).st_size
        if have != size:
            raise error(f"{path} has {have} bytes, {size} were written: it is truncated or damaged; {fix}")
        left = size
        while left:
            block = f.read(min(left, 1 << 22))
            if not block:
                raise error(f"{path} ended after {size - left} of its {size} bytes; it is truncated; {fix}")
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def regular_size(path: Path | str, error: type[MeshforgeError] = MeshforgeError, fix: str = "") -> int:
    """The size of ``path`` (links followed), refused unless it is a regular file."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise error(cannot_read(path, e, fix or "give a regular file")) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(not_regular(path, st.st_mode, fix or "give a regular file"))
    return st.st_size
