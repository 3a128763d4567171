"""Writing only where meshforge means to: never through a link it did not make.

A run directory, an output directory or a checkpoint folder may hold a symbolic link someone
put there (``config.toml -> ~/notes.txt``, ``checkpoints/.tmp-step-4 -> /elsewhere``): written
to, it would overwrite what it points at; removed with ``rmtree``, it fails half-way. So every
path meshforge writes or removes inside a directory it owns is looked at with ``lstat`` first
(``refuse_links`` walks what a run will touch before anything is written), files are created
with ``O_NOFOLLOW``, and directories are made and then checked to be directories, not links.
FIFOs, devices and sockets in those places are refused too: opening one to write blocks or
writes into a device.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from meshforge.errors import MeshforgeError
from meshforge.safeio.files import kind_of

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class LinkRefused(MeshforgeError):
    """A symbolic link (or a FIFO, device or socket) where meshforge writes."""


def _link_message(path: Path, fix: str) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"{path} is a symbolic link (to {target}) where meshforge writes; it never writes through a link it did not "
        f"make (that would overwrite or remove what it points at): {fix}"
    )


def check_entry(path: Path, fix: str) -> os.stat_result | None:
    """``lstat`` of ``path`` (None when there is nothing there), refusing a link, FIFO, device or socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise LinkRefused(_link_message(path, fix))
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise LinkRefused(f"{path} is {kind_of(st.st_mode)} where meshforge writes a file; {fix}")
    return st


def refuse_links(root: Path, names: Iterable[str], fix: str) -> None:
    """Refuse (LinkRefused, naming the first) a link, FIFO, device or socket at any of ``names``
    inside ``root`` or anywhere below those of them that are directories (links not followed)."""
    for name in sorted(names):
        st = check_entry(Path(root) / name, fix)
        if st is not None and stat.S_ISDIR(st.st_mode):
            _walk(Path(root) / name, fix)


def _walk(d: Path, fix: str) -> None:
    try:
        entries = list(os.scandir(d))
    except OSError:
        return  # unreadable: writing there fails on its own, with its own message
    for e in sorted(entries, key=lambda e: e.name):
        st = check_entry(Path(e.path), fix)
        if st is not None and stat.S_ISDIR(st.st_mode):
            _walk(Path(e.path), fix)


def write_new(path: Path | str, data: bytes | str, fix: str = "remove it, or choose another directory") -> None:
    """Write ``data`` to ``path``, replacing a regular file there but never following a link (O_NOFOLLOW)
    and never opening a FIFO or device (refused before the open)."""
    p = Path(path)
    check_entry(p, fix)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link put there since the look
            raise LinkRefused(_link_message(p, fix)) from None
        raise
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def open_append(path: Path | str, fix: str = "remove it, or choose another directory") -> TextIO:
    """The file ``path`` (created if missing) opened to append text, never through a link (O_NOFOLLOW)."""
    p = Path(path)
    check_entry(p, fix)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(p, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkRefused(_link_message(p, fix)) from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


def append_nofollow(path: Path | str, text: str) -> None:
    """Append ``text`` to the file ``path`` (created if missing), never through a link."""
    with open_append(path) as f:
        f.write(text)


def make_dir(path: Path | str, fix: str = "remove it, or choose another directory") -> Path:
    """``path`` as a directory of its own (created with its parents if missing): a link to a directory
    elsewhere is refused, not written into."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        if stat.S_ISLNK(st.st_mode):
            raise LinkRefused(_link_message(p, fix))
        raise LinkRefused(f"{p} is {kind_of(st.st_mode)}, not a directory; {fix}")
    return p


def remove(path: Path | str, fix: str = "remove it yourself") -> bool:
    """Remove what meshforge wrote at ``path`` (a file or a whole directory); a link there is
    refused, never followed or half-removed. Returns whether anything was there."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise LinkRefused(_link_message(p, fix))
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(p)  # (rmtree itself never follows the links inside)
    else:
        p.unlink()
    return True
