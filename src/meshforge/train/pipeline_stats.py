"""Pipeline statistics of a measured step: the bubble (mean over the pp ranks) next to the
schedule's formula, the micro-batches in flight per pp rank, and once per run the timeline
of a step (``pipeline_timeline.json``, drawn by the run report as a Gantt chart). Both
gather over ranks, so they run on measured steps only, the same steps on every rank.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.metrics.chrome_trace import write_timeline_trace
from meshforge.metrics.memory import peak_mem_gib
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.pipeline.runtime import Pipeline
from meshforge.parallel.rules import rank_layout


def gather_pipeline_stats(pipe: Pipeline, mesh: Mesh) -> dict[str, Any]:
    """The last (measured) step's bubble, in-flight counts and (CUDA) peak memory of every pp rank."""
    tl = pipe.timeline()
    mine = torch.tensor([pipe.bubble(), float(tl.max_in_flight() if tl else 0), peak_mem_gib(mesh.device)])
    every = [torch.zeros_like(mine, device=mesh.device) for _ in range(pipe.pp)]
    dist.all_gather(every, mine.to(mesh.device), group=mesh.group("pp"))
    every = [e.cpu() for e in every]
    stats: dict[str, Any] = {
        "bubble_fraction": sum(float(e[0]) for e in every) / pipe.pp,
        "bubble_theory": pipe.theory(),
        "pp_in_flight": [int(e[1]) for e in every],
    }
    if mesh.device.type == "cuda":
        stats["pp_peak_mem_gib"] = [round(float(e[2]), 3) for e in every]
    return stats


def write_gantt(
    pipe: Pipeline, mesh: Mesh, step: int, bubble: float, run_dir: Path, event: Callable[..., None]
) -> None:
    """Gather every rank's timeline of the last (measured) step to rank 0 and write it as
    ``pipeline_timeline.json`` (the run report draws it; the event keeps its name)."""
    every: list = [None] * mesh.world_size
    dist.all_gather_object(every, pipe.timeline())
    if not mesh.is_main:
        return
    coords = rank_layout(mesh.degrees)
    rows = [t for t in every if all(v == 0 for k, v in coords[t.rank].items() if k not in ("pp", "rank"))]
    rows.sort(key=lambda t: coords[t.rank]["pp"])
    path = run_dir / "pipeline_timeline.json"
    path.write_text(json.dumps([dataclasses.asdict(t) for t in rows], indent=0))
    title = f"{pipe.name}, pp={pipe.pp}, m={pipe.m}, step {step}: bubble {bubble:.3f} (theory {pipe.theory():.3f})"
    write_timeline_trace(rows, run_dir / "profile" / f"pipeline-step-{step}.json", title)  # Chrome trace events
    event(
        "pipeline_gantt",
        step=step,
        path=str(path),
        schedule=pipe.name,
        pp=pipe.pp,
        chunks=len(pipe.chunks),
        microbatches=pipe.m,
        bubble=round(bubble, 4),
        bubble_theory=round(pipe.theory(), 4),
    )
