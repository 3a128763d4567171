"""Where ``meshforge convert --out`` and ``meshforge report --out`` write, checked before anything
is read or written: a name too long, a file where a directory should be (or the reverse), a
missing or unwritable parent, and what must never be written over (a folder that holds files,
a run's own files, a file that is not an earlier report) are each one ``meshforge: error:``
paragraph.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshforge.disk import DiskError, check_name_length, describe, existing_ancestor, probe_run_dir
from meshforge.errors import MeshforgeError
from meshforge.run_files import owning_run


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """A directory to create (``convert --out``): new or empty, its nearest existing parent a
    writable directory."""
    check_name_length(out, flag)
    if out.exists() and not out.is_dir():
        raise MeshforgeError(f"{flag} {out} is a file, not a directory; give a new directory to write into")
    if out.is_dir() and any(out.iterdir()):
        raise MeshforgeError(f"{flag} {out} exists and is not empty; choose a new directory")
    probe_run_dir(out, flag)


def check_report_out(out: Path, flag: str = "--out") -> None:
    """A report file to write: not a directory, not one of a run's own files, not a file that is
    not HTML (only an earlier report is replaced), in an existing writable directory."""
    check_name_length(out, flag)
    if out.is_dir():
        raise MeshforgeError(f"{flag} {out} is a directory; give a file name, e.g. {flag} {out / 'report.html'}")
    run = owning_run(out)
    if run is not None:
        raise MeshforgeError(
            f"{flag} {out} is one of the run {run}'s own files; meshforge report never writes over them: give "
            f"another file, e.g. {flag} {run / 'report.html'}"
        )
    if out.exists() or out.is_symlink():
        if not out.is_file() or not _is_html(out):
            raise MeshforgeError(
                f"{flag} {out} exists and is not an HTML file; meshforge report replaces only an earlier report: "
                "give a new file name ending in .html"
            )
    parent = out.absolute().parent
    if not parent.is_dir():
        there = existing_ancestor(parent)
        if not there.is_dir():
            raise MeshforgeError(f"{flag} {out}: {there} is a file, not a directory; write the report elsewhere")
        raise MeshforgeError(
            f"{flag} {out}: the directory {parent} does not exist; create it first (mkdir -p {parent}) or write "
            "the report elsewhere"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        err = PermissionError(13, os.strerror(13), str(parent))
        raise DiskError(describe(parent, err, "write", flag))


def _is_html(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(512).lstrip().lower()
    except OSError:
        return False
    return head.startswith((b"<!doctype html", b"<html"))
