"""Stragglers: on logged steps every rank's compute time is gathered, and a rank slower
than ``factor`` x the median over a window of logged steps is named.

Compute time is the rank's own forward time (forward hooks; synchronised on GPUs on logged
steps only). Forward passes hold no collective under DDP, ZeRO-1/2 and pipelining, so a
rank waiting for a slow peer does not look slow itself, as it would in the step time.
The median is the lower median, so that with two ranks the fast one is the reference.
"""

from __future__ import annotations

import socket
import statistics
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

WINDOW = 5  # logged steps


class StragglerCheck:
    def __init__(self, factor: float, rank: int, world: int, device: torch.device):
        self.factor, self.rank, self.world, self.device = factor, rank, world, device
        self.history: deque[list[float]] = deque(maxlen=WINDOW)
        self.named: set[int] = set()  # ranks already reported (again only after recovering)

    def check(self, compute_s: float, step: int) -> list[dict[str, Any]]:
        """Gather this logged step's compute times (a collective: every rank calls it) and
        return a ``straggler`` event's fields for each rank that newly became one."""
        t = torch.tensor([compute_s], dtype=torch.float64, device=self.device)
        parts = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        self.history.append([float(p) for p in parts])
        means = [statistics.fmean(h[r] for h in self.history) for r in range(self.world)]
        median = statistics.median_low(means)
        if median <= 0:
            return []
        slow = {r for r, m in enumerate(means) if m > self.factor * median}
        new = sorted(slow - self.named)
        self.named = slow
        if not new:
            return []
        hosts: list[Any] = [None] * self.world
        dist.all_gather_object(hosts, socket.gethostname())
        return [
            {
                "step": step,
                "rank": r,
                "host": hosts[r],
                "ratio": round(means[r] / median, 2),
                "compute_s": round(means[r], 5),
                "median_s": round(median, 5),
                "window": len(self.history),
            }
            for r in new
        ]
