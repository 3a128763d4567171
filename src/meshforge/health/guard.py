"""The step guard: asked by the step runner between clipping and the optimizer step.

Good path, no collective of its own: the verdict on non-finite values reads the global
gradient norm, which clipping already reduced and which every rank holds equal (a NaN or
infinity in any rank's loss reaches it through backward and the gradient reduction), so
every rank skips or none does; the one host read of it is the step's only sync. Spike
detection needs the global batch's loss. With ``on_spike = "log"`` each step's local loss
is kept on the device and judged on the next logged step, where the losses since the last
one are reduced in one collective (``reduce``: the step runner's loss reduction) and judged
in order; the events come up to ``metrics.log_interval`` steps late but name their own step
and batch. ``skip`` and ``rollback`` must judge before the update: they reduce every step.
Only when something is wrong does it gather the details (nonfinite.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshforge.config.sections import HealthConfig
from meshforge.health.fault_hooks import RunHooks
from meshforge.health.nonfinite import diagnose
from meshforge.health.spike import SpikeDetector


class StepGuard:
    """One per rank; ``step`` is set by the loop to the (1-based) step about to run."""

    def __init__(
        self,
        cfg: HealthConfig,
        model: nn.Module,
        rank: int,
        distributed: bool,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        hooks: RunHooks | None = None,
    ):
        self.cfg, self.model, self.rank, self.distributed, self.reduce = cfg, model, rank, distributed, reduce
        self.spikes = SpikeDetector(cfg.spike_threshold, cfg.spike_window) if cfg.spike_threshold > 0 else None
        self.hooks = hooks or RunHooks()
        self.step = 0
        self.skipped = 0
        self.verdict: dict[str, Any] | None = None  # what the loop reports after the step
        self.late: list[dict[str, Any]] = []  # logged spikes of earlier steps, judged on this logged step
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, local loss) not yet judged: on_spike = log

    def after_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the step reports (the run's loss hooks: the injected spike fault in tests)."""
        return self.hooks.run_loss(self.step, loss)

    def allow_update(self, loss: torch.Tensor, grad_norm: torch.Tensor, global_loss: float | None) -> bool:
        """Whether the optimizer may step; a refusal (or a logged spike) leaves its reason in ``verdict``.
        ``global_loss``: on logged steps, the global batch's loss (a collective every rank made)."""
        self.verdict, self.late = None, []
        if not math.isfinite(float(grad_norm)):
            found = diagnose(self.model, loss, grad_norm, self.rank, self.distributed)
            return self._refuse("nonfinite", self.cfg.on_nonfinite, found)
        if self.spikes is None:
            return True
        if self.cfg.on_spike == "log":
            self.pending.append((self.step, loss.detach().float()))
            if global_loss is not None:  # a logged step: every rank is here, judge what waited
                self.late = self._judge_pending()
            return True
        if global_loss is None:
            global_loss = float(self.reduce(loss.detach().float()))
        found = self._spike(global_loss)
        return True if found is None else self._refuse("loss_spike", self.cfg.on_spike, found)

    def _spike(self, global_loss: float) -> dict[str, Any] | None:
        assert self.spikes is not None
        median = self.spikes.median()
        score = self.spikes.check(global_loss)
        return None if score is None else {"loss": global_loss, "median": median, "score": round(score, 2)}

    def _judge_pending(self) -> list[dict[str, Any]]:
        """The kept steps' global losses, from one reduction, judged in step order."""
        steps, losses = zip(*self.pending, strict=True)
        self.pending = []
        found = []
        for step, value in zip(steps, self.reduce(torch.stack(losses)).tolist(), strict=True):
            spike = self._spike(value)
            if spike is not None:
                found.append({"event": "loss_spike", "step": step, "action": "log", "lag": self.step - step, **spike})
        return found

    def _refuse(self, event: str, action: str, found: dict[str, Any]) -> bool:
        self.skipped += 1
        if self.skipped > self.cfg.max_skipped:
            action = "stop"
            found["reason"] = f"more than health.max_skipped = {self.cfg.max_skipped} bad steps"
        self.verdict = {"event": event, "step": self.step, "action": action, **found}
        return False
