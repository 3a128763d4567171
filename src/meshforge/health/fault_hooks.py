"""The points of a run where outside behaviour can attach: before and after each step,
after a checkpoint's shards are written, and on a step's loss. A normal run leaves them
empty; fault injection (health/faults.py) fills them, so the loop and the checkpoint saver call
hooks, never the faults themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunHooks:
    before_step: list[Callable[[int], None]] = field(default_factory=list)  # step (1-based) about to run
    after_step: list[Callable[[int], None]] = field(default_factory=list)  # step done (the state advanced)
    shards_written: list[Callable[[int], None]] = field(default_factory=list)  # a save's shards, not yet complete
    loss: list[Callable[[int, Any], Any]] = field(default_factory=list)  # (step, loss) -> the loss the step reports

    def run_before(self, step: int) -> None:
        for h in self.before_step:
            h(step)

    def run_after(self, step: int) -> None:
        for h in self.after_step:
            h(step)

    def run_shards_written(self, step: int) -> None:
        for h in self.shards_written:
            h(step)

    def run_loss(self, step: int, loss: Any) -> Any:
        for h in self.loss:
            loss = h(step, loss)
        return loss
