"""Where a run starts, once its checks passed: rank 0 prepares the run directory (config.toml,
a cleared old run on run.overwrite) and picks the checkpoint to resume from; every rank
agrees on both. ``event_writer`` appends events before (or without) the run log.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshforge.checkpoint import store
from meshforge.checkpoint.resume_point import find_resume_point
from meshforge.config.run_plan import RunPlan
from meshforge.data.corpus import open_data
from meshforge.guards import run_lock
from meshforge.guards.preflight import check_run_dir, resuming
from meshforge.launch.env import restart_count
from meshforge.parallel.mesh import Mesh


def prepare_run_dir(cfg: RunPlan) -> Path:
    """Create run.dir (clearing an old run only when run.overwrite is set and this is not a
    restart) and write config.toml."""
    run_dir = check_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_lock.hold(run_dir, quiet=restart_count() > 0)  # before touching anything in it
    if cfg.run.overwrite and restart_count() == 0:
        for name in ("metrics.jsonl", "events.jsonl", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
        for name in ("tensorboard", "final", "final-hf", "checkpoints"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    store.clean_incomplete(run_dir / "checkpoints")
    return run_dir


def event_writer(run_dir: str | Path) -> Callable[..., None]:
    """Append one event to run_dir/events.jsonl from any rank (before or without a run log)."""

    def write(event: str, **fields: Any) -> None:
        rec = {"time": time.time(), "event": event, **fields}
        path = Path(run_dir) / "events.jsonl"
        if path.parent.is_dir():
            with path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if event == "checkpoint_skipped":  # say it where people look, too
            what = f"skipped checkpoint {fields.get('path')} ({fields.get('reason')}); trying an older one"
            print(f"meshforge: warning: {what}", file=sys.stderr)

    return write


def agree_on_start(plan: RunPlan, mesh: Mesh) -> tuple[RunPlan, str | None]:
    """Rank 0 prepares run.dir and starts from the checkpoint its pre-flight picked (and checked);
    every rank gets its run.dir and that checkpoint."""
    resume = None
    if mesh.is_main:
        point = plan.resume
        if point is None:  # a caller that skipped the pre-flight: look (and refuse) before writing, too
            point = find_resume_point(plan, resuming(plan), len(open_data(plan, plan.shape).train))
        prepare_run_dir(plan)
        for path, why in point.skipped:
            event_writer(plan.run.dir)("checkpoint_skipped", level="warning", path=path, reason=why)
        resume = point.path
    if not mesh.distributed:
        return plan, resume
    obj = [plan.run.dir, resume]
    dist.broadcast_object_list(obj, src=0)
    return plan.with_run_dir(obj[0]), obj[1]
