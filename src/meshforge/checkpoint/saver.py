"""How a run saves checkpoints: synchronous or background saves on a dedicated
process group, completion, retention, choosing what to resume from, and the save cadence.

A background save (``checkpoint.async = true``) goes through ``dcp.async_save``: training
is blocked only while DCP copies the state to host memory; DCP's writer thread then writes
the copy and, when the write is done, the same thread hashes this rank's files, meets the
other ranks on a gloo group of its own and — on rank 0 — marks the checkpoint complete.
The dedicated group keeps the save's collectives off the training group's (sharing one
with a background writer was seen to corrupt gloo traffic or hang). At most one save is
in flight; the next one, and the end of training, wait for it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.checkpoint import store
from meshforge.checkpoint.store import CheckpointError
from meshforge.health.fault_hooks import RunHooks

Event = Callable[..., None]


def rng_state() -> dict[str, Any]:
    out = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


class SaveStats:
    def __init__(self, step: int, path: Path, blocking_s: float):
        self.step, self.path, self.blocking_s = step, path, blocking_s
        self.total_s = 0.0
        self.removed: list[Path] = []


class CheckpointSaver:
    """One per rank. ``event`` logs to events.jsonl (rank 0) and may be a no-op elsewhere.
    ``device`` is unused: DCP's own stager makes the host copy of a background save."""

    def __init__(self, root: Path, mesh: Any, keep: int, event: Event, hooks: RunHooks):
        """``mesh``: this rank's place (rank, distributed); ``hooks``: the run's (shards_written)."""
        self.root, self.rank, self.keep, self.event, self.hooks = root, mesh.rank, keep, event, hooks
        self.distributed = mesh.distributed
        self.group = dist.new_group(backend="gloo") if mesh.distributed else None  # for saves only
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self.last_blocking_s: float | None = None
        self.protect: int | None = None  # a step retention never deletes (a wsd run's stable-phase end)

    # -- saving --------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], background: bool) -> None:
        """Save ``state`` (from sharded.training_state) and ``meta`` (rank 0's) as step ``step``."""
        from meshforge.checkpoint import sharded  # (here: the launcher's pre-flight imports this module, not DCP)

        t0 = time.perf_counter()
        self.wait()
        tmp = store.new_save_dir(self.root / store.tmp_dir_name(step))  # (a link there: refused, not written through)
        stats = SaveStats(step, self.root / store.step_dir_name(step), 0.0)
        rank_meta = {"rank": self.rank, "rng": rng_state()}  # now, not when the write ends
        if background:
            written = sharded.async_save(state, tmp, self.group)
            stats.blocking_s = self.last_blocking_s = time.perf_counter() - t0
            self._pending = _then(written, lambda: self._complete(tmp, rank_meta, meta, stats, t0))
            return
        sharded.save(state, tmp, self.group)
        self._complete(tmp, rank_meta, meta, stats, t0)
        stats.blocking_s = self.last_blocking_s = stats.total_s
        self._report(stats)

    def _complete(
        self, tmp: Path, rank_meta: dict[str, Any], meta: dict[str, Any], stats: SaveStats, t0: float
    ) -> SaveStats:
        """After this rank's shards are written: hash them, meet the other ranks on the save
        group, and on rank 0 mark the checkpoint complete (rename into place) and retain."""
        self.hooks.run_shards_written(stats.step)  # (tests: a fault dies here, its shards written, unmarked)
        mine = sorted(p.name for p in tmp.glob(f"__{self.rank}_*.distcp"))
        store.write_json_atomic(
            tmp / f"rank-{self.rank:05d}.json", {**rank_meta, "files": store.describe_files(tmp, mine)}
        )
        if self.group is not None:
            dist.barrier(group=self.group)
        if self.rank == 0:
            store.finalize(tmp, stats.path, meta)
            stats.removed = store.retain(self.root, self.keep, self.protect)
        if self.group is not None:
            dist.barrier(group=self.group)  # the new checkpoint is in place for everyone
        stats.total_s = time.perf_counter() - t0
        return stats

    def _report(self, stats: SaveStats) -> None:
        self.event(
            "checkpoint_saved",
            step=stats.step,
            path=str(stats.path),
            blocking_s=round(stats.blocking_s, 4),
            total_s=round(stats.total_s, 4),
            removed=[str(p) for p in stats.removed],
        )

    def poll(self) -> None:
        """Report a background save that has finished (raising its error, if it failed)."""
        with self._lock:
            if self._pending is not None and self._pending.done():
                fut, self._pending = self._pending, None
                self._report(fut.result())

    def wait(self) -> None:
        with self._lock:
            if self._pending is not None:
                fut, self._pending = self._pending, None
                self._report(fut.result())

    def close(self) -> None:
        """Wait for a save in flight (the end of training)."""
        self.wait()

    def abandon(self) -> None:
        """On an error: do not wait for a save in flight (its peers may be gone); its
        unfinished checkpoint is never marked complete."""
        self._pending = None


def _then(written: Future, complete: Callable[[], SaveStats]) -> Future:
    """A future for the whole background save: DCP's write, then ``complete`` on the thread
    that finished the write (DCP's writer thread), its error (or the write's) kept for
    whoever polls or waits."""
    out: Future = Future()

    def run(f: Future) -> None:
        try:
            f.result()
            out.set_result(complete())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            out.set_exception(e)

    written.add_done_callback(run)
    return out


# ----------------------------------------------------------------------------- resuming


def checkpoint_to_load(load: str, root: Path, event: Event) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint ``checkpoint.load`` names, verified (files and their hashes: ``store.verify``),
    and its meta.json; (None, None) to start fresh. ``latest`` takes the newest complete checkpoint
    in ``root`` that verifies, falling back to older ones (each skip is a warning event); ``none``
    never resumes; a path (a checkpoint, or a run's checkpoints/ folder: its newest) must verify.
    """
    if load in ("none", ""):
        return None, None
    if load != "latest":
        path = Path(load)
        if (path / store.COMPLETE).exists() or (path / "meta.json").exists() or not path.is_dir():
            return path, store.verify(path)
        complete = store.list_complete(path)  # a run directory's checkpoints/ folder
        if not complete:
            raise CheckpointError(f"checkpoint.load = {load}: no complete checkpoint in {path}")
        return complete[-1].path, store.verify(complete[-1].path)
    reasons = []
    for c in reversed(store.list_complete(root)):
        try:
            return c.path, store.verify(c.path)
        except CheckpointError as e:
            event("checkpoint_skipped", level="warning", path=str(c.path), reason=str(e))
            reasons.append(str(e))
    if reasons:  # starting over silently inside a run that has checkpoints would mix two runs
        raise CheckpointError(
            f"no checkpoint in {root} can be loaded: " + " | ".join(reasons) + "; repair or remove them, or start "
            "a new run (another run.dir, or run.overwrite = true)"
        )
    return None, None


def model_shape_hash(model_args: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(model_args, sort_keys=True).encode()).hexdigest()[:16]


def young_daly_steps(blocking_s: float, mtbf_hours: float, step_time_s: float) -> tuple[int, float]:
    """The checkpoint interval that minimises expected lost + saving time: sqrt(2·C·MTBF)
    seconds (Young 1974, Daly 2006), as a whole number of steps (at least 1)."""
    seconds = math.sqrt(2 * max(blocking_s, 1e-6) * mtbf_hours * 3600)
    return max(1, round(seconds / max(step_time_s, 1e-9))), seconds
