"""Ctrl-C / SIGTERM: finish a step, save what we have, stop -- on every rank at the same step.

A signal only sets a flag on the rank that got it. Agreeing on it is a world all-reduce,
so the ranks do that only every ``every`` steps and before a logged step (the same steps
everywhere), and do it *before* the step: the step after the agreement is then run as the
last one, measured and logged like any last step. A single process checks every step (no
collective needed). A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshforge.parallel.mesh import Mesh

AGREE_EVERY = 10


class StopRequest:
    """Use as a context (installs the handlers); ask ``stop_after(step, logged)`` before each step."""

    def __init__(self, mesh: Mesh, say: Callable[[str], None], every: int = AGREE_EVERY):
        self.mesh, self.say, self.every = mesh, say, every
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second Ctrl-C means "now"
            raise KeyboardInterrupt
        self.requested = True
        self.say(
            "\nstop requested: finishing the next step, then saving what we have (press Ctrl-C again to abort at once)"
        )

    def stop_after(self, step: int, logged: bool) -> bool:
        """Whether step ``step`` (1-based, about to run) is the last: the ranks' agreed flag,
        looked at every ``every`` steps and at logged steps (a collective then)."""
        if not self.mesh.distributed:
            return self.requested
        if not logged and step % self.every:
            return False
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.mesh.device)
        dist.all_reduce(flag)
        return bool(flag.item())
