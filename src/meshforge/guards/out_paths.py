"""Where ``meshforge convert --out`` and ``meshforge report --out`` write, checked before anything
is read or written: a name too long, a file where a directory should be (or the reverse), a
missing or unwritable parent, and what must never be written over (a folder that holds files,
a run's own files, a file that is not an earlier report) are each one ``meshforge: error:``
paragraph.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from meshforge.errors import MeshforgeError
from meshforge.guards.disk import DiskError, check_name_length, describe, existing_ancestor, probe_run_dir
from meshforge.guards.foreign_files import owning_run


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """A directory to create (``convert --out``): new or empty, its nearest existing parent a
    writable directory."""
    check_name_length(out, flag)
    run = owning_run(out)
    if run is not None:
        raise MeshforgeError(f"{flag} {out} is inside the run {run}'s own folders; give a directory outside them")
    if out.exists() and not out.is_dir():
        raise MeshforgeError(f"{flag} {out} is a file, not a directory; give a new directory to write into")
    if out.is_dir() and any(out.iterdir()):
        raise MeshforgeError(f"{flag} {out} exists and is not empty; choose a new directory")
    probe_run_dir(out, flag)


def check_file_out(out: Path, flag: str, replaceable: Callable[[Path], bool] | None, what: str) -> None:
    """A file to write: not a directory, not one of a run's own files, not an existing file unless
    ``replaceable`` says it is ``what`` (an earlier output of the same command), in an existing
    writable directory."""
    check_name_length(out, flag)
    if out.is_dir():
        raise MeshforgeError(f"{flag} {out} is a directory; give a file name, e.g. {flag} {out / ('out' + out.suffix)}")
    run = owning_run(out)
    if run is not None:
        raise MeshforgeError(
            f"{flag} {out} is one of the run {run}'s own files; meshforge never writes over them: give another file"
        )
    if out.is_symlink():
        raise MeshforgeError(
            f"{flag} {out} is a symbolic link (to {os.readlink(out)}); meshforge never writes through a link it did "
            "not make: give the file's own path, or a new file name"
        )
    if out.exists() and not (replaceable and out.is_file() and replaceable(out)):
        why = (
            f"is not {what}, the only file it replaces"
            if replaceable
            else "exists; meshforge does not write over files"
        )
        raise MeshforgeError(f"{flag} {out} {why}: give a new file name")
    parent = out.absolute().parent
    if not parent.is_dir():
        there = existing_ancestor(parent)
        if not there.is_dir():
            raise MeshforgeError(f"{flag} {out}: {there} is a file, not a directory; write elsewhere")
        raise MeshforgeError(
            f"{flag} {out}: the directory {parent} does not exist; create it (mkdir -p {parent}) or write elsewhere"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        err = PermissionError(13, os.strerror(13), str(parent))
        raise DiskError(describe(parent, err, "write", flag))


def check_report_out(out: Path) -> None:
    """``report --out``: replaces only an earlier report (an HTML file)."""
    check_file_out(out, "--out", _is_html, "an earlier report (an HTML file)")


def check_profile_out(out: Path) -> None:
    """``calibrate --out``: replaces only an earlier hardware profile."""
    check_file_out(out, "--out", _is_profile, "a hardware profile written by meshforge calibrate")


def _is_profile(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "peak_flops" in data and "name" in data


def _is_html(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(512).lstrip().lower()
    except OSError:
        return False
    return head.startswith((b"<!doctype html", b"<html"))
