"""The step guard: asked by the step runner between clipping and the optimizer step.

Good path: one all-reduce over the world of two numbers -- a flag (is this rank's loss or
the global gradient norm non-finite?) and this rank's loss (their sum x pp / world is the
global batch's mean loss: tensor-parallel ranks hold the same loss, only the last pipeline
stage a non-zero one) -- and one host read of it. Logged steps use the runner's exact
reduced loss for spike detection instead.
Only when something is wrong does it gather the details (nonfinite.py). Every rank reaches
the same verdict from the same reduced values, so all skip (or none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge import faults
from meshforge.config import HealthConfig
from meshforge.health.nonfinite import diagnose
from meshforge.health.spike import SpikeDetector


class StepGuard:
    """One per rank; ``step`` is set by the loop to the (1-based) step about to run."""

    def __init__(
        self, cfg: HealthConfig, model: nn.Module, rank: int, distributed: bool, device: torch.device, loss_scale: float
    ):
        self.cfg, self.model, self.rank, self.distributed, self.device = cfg, model, rank, distributed, device
        self.loss_scale = loss_scale  # pp / world: the world's summed losses -> the global mean loss
        self.spikes = SpikeDetector(cfg.spike_threshold, cfg.spike_window) if cfg.spike_threshold > 0 else None
        self.step = 0
        self.skipped = 0
        self.verdict: dict[str, Any] | None = None  # what the loop reports after the step

    def after_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Apply the injected nan / spike faults (tests); returns the loss the step reports."""
        if faults.nan_now(self.rank, self.step):
            params = [p for p in self.model.parameters() if p.grad is not None]
            g = params[len(params) // 2].grad
            with torch.no_grad():
                (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
        if faults.spike_now(self.step):
            loss = loss * faults.SPIKE_FACTOR
        return loss

    def allow_update(self, loss: torch.Tensor, grad_norm: torch.Tensor, global_loss: float | None) -> bool:
        """Whether the optimizer may step; a refusal leaves its reason in ``verdict``."""
        self.verdict = None
        bad = ~torch.isfinite(grad_norm.to(self.device)).all() | ~torch.isfinite(loss.detach()).all()
        both = torch.stack([bad.float(), loss.detach().float().sum()])
        if self.distributed:
            dist.all_reduce(both)
        flag, summed = both.tolist()
        if global_loss is None:
            global_loss = summed * self.loss_scale
        if flag > 0:
            found = diagnose(self.model, loss, grad_norm, self.rank, self.distributed)
            return self._refuse("nonfinite", self.cfg.on_nonfinite, found)
        if self.spikes is not None and global_loss is not None:
            median = self.spikes.median()
            score = self.spikes.check(global_loss)
            if score is not None:
                found = {"loss": global_loss, "median": median, "score": round(score, 2)}
                if self.cfg.on_spike == "log":
                    self.verdict = {"event": "loss_spike", "step": self.step, "action": "log", **found}
                    return True
                return self._refuse("loss_spike", self.cfg.on_spike, found)
        return True

    def _refuse(self, event: str, action: str, found: dict[str, Any]) -> bool:
        self.skipped += 1
        if self.skipped > self.cfg.max_skipped:
            action = "stop"
            found["reason"] = f"more than health.max_skipped = {self.cfg.max_skipped} bad steps"
        self.verdict = {"event": event, "step": self.step, "action": action, **found}
        return False
