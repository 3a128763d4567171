"""The on-disk layout of training checkpoints: where they go, when one counts as complete,
how one is checked before loading, and which are kept.

    run.dir/checkpoints/
      step-00000100/            a complete checkpoint (renamed into place last)
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP: model + optimizer shards
        rank-00000.json, ...    per rank: RNG states and the sha256/size of its shard files
        meta.json               step, tokens, sampler, model shape, layout, config, file list
        COMPLETE                written after meta.json; nothing without it is ever loaded
      .tmp-step-00000200/       a save in progress (or cut short by a crash): ignored, cleaned up

A checkpoint is written into ``.tmp-step-N`` by every rank, then rank 0 writes meta.json
and COMPLETE and renames the directory; a crash at any moment leaves either a complete
checkpoint or a temporary directory that is never listed. Before loading, every file
named in meta.json is checked for size and sha256, and DCP's pickled ``.metadata`` for
the hash recorded when it was written, so a truncated or corrupted shard is caught (and
the previous checkpoint used) instead of failing half-way through a collective load. The
hashes stop damage, not tampering: ``.metadata`` is also read by a restricted unpickler
(safe_metadata.py) before DCP sees it, so a crafted checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.checkpoint.safe_metadata import UnsafeCheckpointError, read_metadata
from meshforge.checkpoint.validate import CheckpointError, check_rank_files, check_state, check_storage, readable_shape
from meshforge.data.manifest import read_manifest
from meshforge.safeio.files import regular_size, sha256_declared
from meshforge.safeio.links import make_dir, remove
from meshforge.safeio.parse import read_json
from meshforge.safeio.schema import FILE_NAME, Int, MapOf, Obj, Str

FORMAT = "meshforge-checkpoint"
VERSION = 1
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(r"^rank-\d{5}\.json$")
_FILE = Obj({"bytes": Int(0), "sha256": Str(r"[0-9a-f]{64}")})
META = Obj({"files": MapOf(Str(FILE_NAME), _FILE)})  # what verify trusts (the rest: resume_point.py)
_LINK_FIX = "remove it (meshforge makes every checkpoint directory itself)"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int) -> str:
    return f".tmp-{step_dir_name(step)}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": sha256_file(directory / n)} for n in names}


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class CheckpointInfo:
    path: Path
    step: int


def list_complete(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root``, oldest first (a directory without COMPLETE is not one)."""
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and not d.is_symlink() and (d / COMPLETE).exists():  # (a link is never one)
            out.append(CheckpointInfo(d, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def clean_incomplete(root: Path) -> list[Path]:
    """Remove temporary directories left by saves that never finished."""
    removed = []
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".tmp-step-") and remove(d, _LINK_FIX):  # a link there is refused, not followed
                removed.append(d)
    return removed


def new_save_dir(path: Path) -> Path:
    """The temporary directory of a save, a directory of its own: a link put in its place (or left
    there) is refused, never written through."""
    return make_dir(path, _LINK_FIX)


def finalize(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank has written its part: record the files, mark complete, rename."""
    rank_files = sorted(p.name for p in tmp.glob("rank-*.json"))
    files: dict[str, dict[str, Any]] = {}
    for name in rank_files:
        files.update(read_json(tmp / name, CheckpointError)["files"])
    files.update(describe_files(tmp, [".metadata", *rank_files]))
    write_json_atomic(tmp / "meta.json", {"format": FORMAT, "version": VERSION, **meta, "files": files})
    (tmp / COMPLETE).write_text("ok\n")
    _fsync_dir(tmp)
    remove(final, _LINK_FIX)  # a checkpoint of the same step from an earlier attempt (a link: refused)
    tmp.rename(final)
    _fsync_dir(final.parent)


def read_meta(path: Path) -> dict[str, Any]:
    fix = "delete this checkpoint directory or point checkpoint.load at another one"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory); {fix}")
    if not (path / COMPLETE).exists():
        raise CheckpointError(
            f"checkpoint {path} has no {COMPLETE} mark: its save never finished, so it is never loaded; "
            "use an earlier checkpoint"
        )
    return read_manifest(path / "meta.json", FORMAT, VERSION, CheckpointError, fix, META)


def verify(path: Path, optimizer: bool = True) -> dict[str, Any]:
    """meta.json of a complete checkpoint whose every file is a regular file of its recorded size
    and hash (read no further than that size), whose rank files and ``.metadata`` are plain data,
    and whose tensors are those of the model meta.json describes (validate.py; ``optimizer``: with
    Adam's state). Any failure is a CheckpointError, so ``latest`` falls back past it."""
    meta = read_meta(path)
    files = meta["files"]
    fix = "the checkpoint is damaged"
    for name, want in files.items():
        f = path / name
        if not f.exists() and not f.is_symlink():
            raise CheckpointError(f"checkpoint file {f} is missing; the checkpoint is damaged")
        size = regular_size(f, CheckpointError, fix)  # (a FIFO or device, even behind a link, is refused)
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint file {f} has {size} bytes, {want['bytes']} were written: it is truncated or damaged"
            )
        if sha256_declared(f, want["bytes"], CheckpointError, fix) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {f} does not match the hash recorded when it was written")
    if ".metadata" not in files:
        raise CheckpointError(f"{path / 'meta.json'} lists no .metadata; the checkpoint is damaged")
    try:  # matching hashes stop damage, not tampering: the metadata must also be plain data
        md = read_metadata(path / ".metadata")
    except UnsafeCheckpointError as e:
        raise CheckpointError(str(e)) from None
    check_storage(md, {n: w["bytes"] for n, w in files.items()}, path)
    check_rank_files(path, sorted(n for n in files if _RANK_FILE.match(n)))
    shape = readable_shape(meta, path)  # (none: the resume check refuses it, naming meta.json)
    if shape is not None:
        check_state(md, shape, path, optimizer)
    return meta


def holds_train_state(path: Path) -> bool:
    """Whether the shards carry the train state (step, tokens, sampler) beside meta.json's
    copy: checkpoints written since 2026-11-27 do; older ones are resumed from meta.json alone."""
    keys = read_metadata(path / ".metadata").state_dict_metadata
    return any(k == "train.step" or k.endswith(".train.step") for k in keys)


def retain(root: Path, keep: int, protect: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (and the one of step ``protect``:
    a wsd run's stable-phase end, which extending the run continues from); returns what was removed."""
    complete = [c for c in list_complete(root) if c.step != protect]
    removed = []
    for c in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(c.path, ignore_errors=True)  # (list_complete lists no link)
        removed.append(c.path)
    return removed
