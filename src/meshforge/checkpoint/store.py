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
from meshforge.data.manifest import read_manifest
from meshforge.errors import MeshforgeError

FORMAT = "meshforge-checkpoint"
VERSION = 1
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(MeshforgeError):
    """A checkpoint that cannot be used; the message names the file."""


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
        if m and d.is_dir() and (d / COMPLETE).exists():
            out.append(CheckpointInfo(d, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def clean_incomplete(root: Path) -> list[Path]:
    """Remove temporary directories left by saves that never finished."""
    removed = []
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".tmp-step-") and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


def finalize(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank has written its part: record the files, mark complete, rename."""
    rank_files = sorted(p.name for p in tmp.glob("rank-*.json"))
    files: dict[str, dict[str, Any]] = {}
    for name in rank_files:
        files.update(json.loads((tmp / name).read_text())["files"])
    files.update(describe_files(tmp, [".metadata", *rank_files]))
    write_json_atomic(tmp / "meta.json", {"format": FORMAT, "version": VERSION, **meta, "files": files})
    (tmp / COMPLETE).write_text("ok\n")
    _fsync_dir(tmp)
    if final.exists():  # a checkpoint of the same step from an earlier attempt
        shutil.rmtree(final)
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
    return read_manifest(path / "meta.json", FORMAT, VERSION, CheckpointError, fix)


def verify(path: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint whose every file has its recorded size and hash."""
    meta = read_meta(path)
    files = meta.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(w, dict) for w in files.values()):
        raise CheckpointError(f"{path / 'meta.json'} has no readable file list; the checkpoint is damaged")
    for name, want in files.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} is missing; the checkpoint is damaged")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint file {f} has {size} bytes, {want['bytes']} were written: it is truncated or damaged"
            )
        if sha256_file(f) != want.get("sha256"):
            raise CheckpointError(f"checkpoint file {f} does not match the hash recorded when it was written")
    if ".metadata" not in meta.get("files", {}):
        raise CheckpointError(f"{path / 'meta.json'} lists no .metadata; the checkpoint is damaged")
    try:  # matching hashes stop damage, not tampering: the metadata must also be plain data
        read_metadata(path / ".metadata")
    except UnsafeCheckpointError as e:
        raise CheckpointError(str(e)) from None
    return meta


def holds_train_state(path: Path) -> bool:
    """Whether the shards carry the train state (step, tokens, sampler) beside meta.json's
    copy: checkpoints written since 2026-11-27 do; older ones are resumed from meta.json alone."""
    keys = read_metadata(path / ".metadata").state_dict_metadata
    return any(k == "train.step" or k.endswith(".train.step") for k in keys)


def retain(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns what was removed."""
    complete = list_complete(root)
    removed = []
    for c in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(c.path, ignore_errors=True)
        removed.append(c.path)
    return removed
