"""Chrome trace events (the JSON that Perfetto and chrome://tracing open) for the executed
pipeline timeline, so it can be looked at next to torch.profiler's per-rank traces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}


def timeline_trace(rows: Sequence[Any], title: str) -> dict[str, Any]:
    """One process ("pipeline") with a thread per pp rank; each action a complete event (ph X)."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    for row in rows:
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": row.rank, "args": {"name": f"rank {row.rank}"}}
        )
        for a in row.actions:
            events.append(
                {
                    "name": f"{a.kind}{a.microbatch}" + (f" c{a.chunk}" if a.chunk else ""),
                    "cat": NAMES.get(a.kind, a.kind),
                    "ph": "X",
                    "pid": 0,
                    "tid": row.rank,
                    "ts": a.start * 1e6,
                    "dur": max(0.0, a.end - a.start) * 1e6,
                    "args": {"microbatch": a.microbatch, "chunk": a.chunk},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timeline_trace(rows: Sequence[Any], path: Path, title: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timeline_trace(rows, title)))
    return path
