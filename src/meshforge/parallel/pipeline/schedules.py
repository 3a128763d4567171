"""Pipeline schedules: their names, the model chunks each runs per rank, and their bubble.

Facts about the schedules, shared by the layout rules (parallel/rules.py), the pipeline
(parallel/pipeline/runtime.py) and the planner; which schedule a layout may use is a rule in dims/.
"""

from __future__ import annotations

import importlib

# pipeline schedule -> (torch.distributed.pipelining class, model chunks per rank: "1", ">=1", ">=2" or "2")
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "1"),
    "1f1b": ("Schedule1F1B", "1"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", ">=2"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", ">=1"),
    "zbv": ("ScheduleZBVZeroBubble", "2"),
    "dualpipev": ("ScheduleDualPipeV", "2"),
}
SCHEDULE_ALIASES = {"interleaved": "interleaved_1f1b", "interleaved1f1b": "interleaved_1f1b", "zb": "zero_bubble"}
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank placed in a V
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")  # input and weight gradients in separate passes


def schedule_name(name: str) -> str:
    return SCHEDULE_ALIASES.get(name.lower(), name.lower())


def schedule_available(name: str) -> bool:
    """Whether the installed PyTorch has this schedule's class."""
    pipelining = importlib.import_module("torch.distributed.pipelining")
    return getattr(pipelining, SCHEDULES[name][0], None) is not None


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    return 2 if schedule_name(schedule) in V_SHAPED else virtual_stages


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipelined step: (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al.
    2019; Narayanan et al. 2021), divided by v for interleaved 1F1B; the zero-bubble
    schedules (Qi et al. 2023) fill most of it with deferred weight-gradient work, counted
    here as a third of the 1F1B bubble."""
    if p <= 1:
        return 0.0
    b = (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return b / v
    if schedule in SPLIT_BACKWARD:
        return b / 3
    return b
