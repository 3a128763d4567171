"""The run directory around the run: ``prepare_run_dir`` readies it for the run the pre-flight
accepted (by the lock's one holder, cli/train.py's ``holding_run_dir``), ``event_writer``
appends an event before (or without) the run log. Light on purpose: ``--nproc N``'s launcher
imports it, and nothing of torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshforge.config.run_plan import RunPlan
from meshforge.launch.env import restart_count
from meshforge.safeio.links import append_nofollow, remove, write_new


def prepare_run_dir(plan: RunPlan) -> Path:
    """Ready run.dir for the run its pre-flight accepted (the caller holds its lock): clear an old
    run when run.overwrite is set (not on an elastic restart, which continues it) and write
    config.toml, the resolved plan."""
    run_dir = Path(plan.run.dir)
    if plan.run.overwrite and restart_count() == 0:
        for name in (
            "metrics.jsonl",
            "events.jsonl",
            "summary.json",
            "tensorboard",
            "final",
            "final-hf",
            "checkpoints",
        ):
            remove(run_dir / name)  # (a link there was refused by the pre-flight; here too, never followed)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_new(run_dir / "config.toml", plan.to_toml())  # O_NOFOLLOW: never through a link put there
    return run_dir


def forget_unstarted(run_dir: Path) -> bool:
    """Remove the config.toml of a run directory this launch created when nothing else was written
    into it (its ranks were stopped or refused before they wrote a line): a run that never started
    leaves nothing behind. Returns whether it did (the lock's holder then removes the directory)."""
    try:
        names = {e.name for e in os.scandir(run_dir)}
    except OSError:
        return False
    if not names <= {"config.toml", "run.lock"}:
        return False
    remove(run_dir / "config.toml")
    return True


def event_writer(run_dir: str | Path) -> Callable[..., None]:
    """Append one event to run_dir/events.jsonl from any rank (before or without a run log)."""

    def write(event: str, **fields: Any) -> None:
        rec = {"time": time.time(), "event": event, **fields}
        path = Path(run_dir) / "events.jsonl"
        if path.parent.is_dir():
            append_nofollow(path, json.dumps(rec) + "\n")
        if event == "checkpoint_skipped":  # say it where people look, too
            what = f"skipped checkpoint {fields.get('path')} ({fields.get('reason')}); trying an older one"
            print(f"meshforge: warning: {what}", file=sys.stderr)

    return write
