"""Where a measured step's time went, per rank: data, compute, exposed communication,
pipeline bubble, optimizer, other (measurement itself, checks).

Taken from timestamps on measured (logged) steps only: the step's start, the first forward
(a model forward pre-hook: before it is data), the optimizer step (optimizer hooks), and
the communication counter's blocked time per mesh axis (blocking collectives, waits on the
overlapped paths' work, plus the tail of asynchronous ones such as DDP's last gradient
bucket): the exposed communication, and each axis's part of it (``exposed_comm_<axis>_s``).
Compute is what is left of forward, backward and clipping after exposed communication and
(pipelines) the measured bubble. On GPUs the hooks synchronise the device on measured steps only.

The run's summary (``run_breakdown``) covers the whole wall time: every step's host time split
in the logged steps' proportions, plus host-timed checkpoint, eval and logging phases, and the
remainder as other.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.parallel.comm_stats import CommCounter

PARTS = ("data_s", "compute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "other_s")


class StepClock:
    def __init__(self, called: list[nn.Module], optimizer: torch.optim.Optimizer, comm: CommCounter | None, device):
        """``called``: the modules forward runs (the model, or under pp this rank's stage parts)."""
        self.comm, self.device = comm, device
        # the mesh axes whose exposed time is told apart (the same list on every rank); not pp:
        # a stage's point-to-point waits are idle time the measured bubble already holds, and
        # counted twice they left no compute on a busy machine (bubble 0.87 + waits 0.13 of a step)
        self.axes = sorted(set(comm.axis_of_group.values()) - {"pp"}) if comm else []
        self.measured, self.t0, self.t_end = False, 0.0, 0.0
        self.first_forward: float | None = None
        self.opt: list[float | None] = [None, None]
        for m in called:
            m.register_forward_pre_hook(self._forward)
        optimizer.register_step_pre_hook(lambda *_: self._opt(0))
        optimizer.register_step_post_hook(lambda *_: self._opt(1))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, *_: Any) -> None:
        if self.measured and self.first_forward is None:
            self.first_forward = self._now()

    def _opt(self, i: int) -> None:
        if self.measured:
            self.opt[i] = self._now()

    def start(self, t0: float, measured: bool) -> None:
        self.t0, self.measured, self.first_forward, self.opt = t0, measured, None, [None, None]

    def stop(self) -> None:
        if self.measured:
            self.t_end = time.perf_counter()
            self.measured = False

    def mine(self, bubble_fraction: float) -> list[float]:
        """This rank's parts of the last measured step, in PARTS order."""
        fwd = self.first_forward or self.t0
        opt_start, opt_end = self.opt[0] or self.t_end, self.opt[1] or self.opt[0] or self.t_end
        run = max(0.0, opt_start - fwd)
        by_axis = {a: t for a, t in (self.comm.exposed_by_axis() if self.comm else {}).items() if a in self.axes}
        total = sum(by_axis.values())
        exposed = min(run, total)
        bubble = bubble_fraction * run
        compute = max(0.0, run - exposed - bubble)
        parts = [fwd - self.t0, compute, exposed, bubble, opt_end - opt_start]
        scale = exposed / total if total > 0 else 0.0  # (capped at the run like the whole)
        other = max(0.0, (self.t_end - self.t0) - sum(parts))
        return [*parts, other, *(by_axis.get(a, 0.0) * scale for a in self.axes)]

    def breakdown(self, bubble_fraction: float, distributed: bool) -> dict[str, Any]:
        """The mean over ranks of each part and of each axis's share of the exposed
        communication (``exposed_comm_<axis>_s``), and every rank's parts (a gather on
        distributed runs: every rank calls this on the same steps)."""
        mine = torch.tensor(self.mine(bubble_fraction), dtype=torch.float64)
        rows = [mine]
        if distributed:
            rows = [torch.zeros_like(mine, device=self.device) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine.to(self.device))
        table = [[round(float(x), 6) for x in r.cpu()] for r in rows]
        keys = [*PARTS, *(axis_key(a) for a in self.axes)]
        out: dict[str, Any] = {k: sum(r[i] for r in table) / len(table) for i, k in enumerate(keys)}
        out["by_rank"] = [r[: len(PARTS)] for r in table]
        return out


def axis_key(axis: str) -> str:
    """The breakdown's key for one mesh axis's exposed communication."""
    return f"exposed_comm_{axis}_s"


class PhaseTimer:
    """Host-clock totals of the loop's phases outside the steps (checkpoint, eval, logging):
    two ``perf_counter`` calls per phase, no device sync."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0


def run_breakdown(wall_s: float, steps_s: float, step_parts: dict[str, float], phases: dict[str, float]) -> dict:
    """Where the run's whole wall time went. The steps' host time (``steps_s``) is split in the
    proportions measured on the logged steps (``step_parts``: their PARTS summed); checkpoint,
    eval and logging are host-timed phases; ``other_s`` is the remainder (in-step checks and
    measurement, the loop itself), so the parts add up to ``wall_s``."""
    measured = sum(step_parts.get(k, 0.0) for k in PARTS)
    out: dict[str, float] = {}
    axes = [k for k in step_parts if k.startswith("exposed_comm_") and k != "exposed_comm_s"]
    for k in PARTS[:-1]:  # the step's own "other" goes to the remainder
        out[k] = steps_s * step_parts.get(k, 0.0) / measured if measured > 0 else 0.0
    for k in ("checkpoint", "eval", "logging"):
        out[f"{k}_s"] = phases.get(k, 0.0)
    out = {k: round(v, 6) for k, v in out.items()}
    wall = round(wall_s, 6)
    out["other_s"] = round(max(0.0, wall - sum(out.values())), 6)  # after rounding: the parts add up
    out["wall_s"] = wall
    for k in axes:  # each axis's share of exposed_comm_s, in the same proportion (not added again)
        out[k] = round(steps_s * step_parts[k] / measured, 6) if measured > 0 else 0.0
    return out
