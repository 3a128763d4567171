"""What a rank does when its run fails: record it, clean up, and say it once.

Every rank appends a ``failure`` event (best effort: on a full disk even that can fail) and
rank 0 removes the partial ``.tmp-step-*`` of a save cut short (the complete checkpoints
before it stay). A user-fixable disk error anywhere in the exception (a full or read-only
disk, permissions) comes back as a DiskError: the CLI prints it as one paragraph, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from meshforge.checkpoint import store
from meshforge.checkpoint.continuing import resume_hint
from meshforge.config.run_plan import RunPlan
from meshforge.errors import MeshforgeError
from meshforge.guards.disk import checkpoint_bytes, disk_error
from meshforge.health import peer_lost
from meshforge.train.run_dir import event_writer


def on_failure(plan: RunPlan, rank: int, world: int, exc: BaseException) -> BaseException | None:
    """Record and clean up after ``exc``; returns the error to raise instead (a DiskError), or None."""
    run_dir = Path(plan.run.dir)
    if isinstance(exc, BrokenPipeError) and world > 1:  # first: the other ranks read it when this one leaves
        peer_lost.mark_reader_gone()
    elif world > 1 and peer_lost.is_peer_lost(exc) and peer_lost.ask_reader_gone():
        return None  # rank 0 stopped because `| head` closed its stdout: stop quietly, record nothing
    disk = disk_error(exc, run_dir, _checkpoint_bytes(plan)) if not isinstance(exc, MeshforgeError) else None
    if rank == 0:  # first: on a full disk this frees the room the event needs
        try:
            store.clean_incomplete(run_dir / "checkpoints")
        except OSError:
            pass
    shown = disk or exc
    try:
        event_writer(plan.run.dir)("failure", rank=rank, error=f"{type(shown).__name__}: {shown}"[:2000])
    except OSError:
        pass  # the disk that failed the run may refuse the event too; the console still says it
    if rank == 0 and not isinstance(exc, BrokenPipeError):  # `meshforge train | head`: the reader left, stop quietly
        print(f"meshforge: the run failed; {resume_hint(plan, world, False)}", file=sys.stderr)
    return disk


def _checkpoint_bytes(plan: RunPlan) -> int:
    """One checkpoint's size (0 if it cannot be told): rank 0 may free its partial save before
    another rank judges a short write, so the room left is held against this, not against zero."""
    try:
        return checkpoint_bytes(plan.shape, plan.train.precision)
    except Exception:  # noqa: BLE001 - a failing run's diagnosis must not fail
        return 0
