"""Going back to the last complete checkpoint after a bad step (``health.on_nonfinite`` or
``health.on_spike = "rollback"``): every rank loads it (a collective), then the data order
moves past the bad step's batch, so the batches in between are skipped (PaLM's recipe). After
silent corruption (``health.on_sdc = "rollback"``) the data was good: the steps since are redone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshforge.checkpoint import store
from meshforge.checkpoint.resume_point import latest_checkpoint
from meshforge.checkpoint.run_checkpoints import RunCheckpoints
from meshforge.checkpoint.train_state import TrainState
from meshforge.health.keeper import HealthStop
from meshforge.metrics.sinks import trim_metrics
from meshforge.parallel.mesh import Mesh


def roll_back(
    bad_step: int,
    checkpoints: RunCheckpoints,
    state: TrainState,
    mesh: Mesh,
    *,
    event: Callable[..., Any],
    say: Callable[[str], None],
    redo: bool = False,
) -> None:
    """Load the newest complete checkpoint into the model, optimizer and ``state``, keeping the
    sampler just past the bad batch (``redo``: where the checkpoint left it); ``event``, ``say``: the run log's."""
    checkpoints.checkpointer.wait()
    consumed = state.sampler.consumed  # just past the bad batch
    run_dir = checkpoints.run_dir
    root = run_dir / "checkpoints"
    found = [str(latest_checkpoint(checkpoints.plan, root, event)[0] or "")] if mesh.is_main else [""]
    if mesh.distributed:
        dist.broadcast_object_list(found, src=0)
    if not found[0]:
        raise HealthStop(f"step {bad_step} asks for a rollback but {root} has no complete checkpoint yet")
    path = Path(found[0])
    meta = store.read_meta(path)
    dropped = trim_metrics(run_dir, meta["step"]) if mesh.is_main else 0
    say(checkpoints.resume(path, meta, dropped))
    skipped = 0 if redo else consumed // state.sampler.batch - meta["sampler"]["consumed"] // state.sampler.batch
    if not redo:
        state.sampler.consumed = consumed
    event("rollback", bad_step=bad_step, to_step=state.step, path=str(path), batches_skipped=skipped)
