"""The step guard: asked by the step runner between clipping and the optimizer step.

Good path, no collective of its own: the verdict on non-finite values reads the global
gradient norm, which clipping already reduced and which every rank holds equal (a NaN or
infinity in any rank's loss reaches it through backward), so every rank skips or none
does; the one host read of it is the step's only sync. Spike detection needs the global
batch's loss: logged steps pass the runner's exact reduced loss; on other steps this
rank's loss is summed over the world (x pp / world is the global mean: tensor-parallel
ranks hold the same loss, only the last pipeline stage a non-zero one). With
``on_spike = "log"`` that all-reduce is asynchronous and judged at the next step, so it
overlaps the optimizer step and the next forward (the event still names the step it
belongs to); ``skip`` and ``rollback`` must judge before the update and wait for it.
Only when something is wrong does it gather the details (nonfinite.py).
"""

from __future__ import annotations

import math
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
        self.forward_module = model  # the module the nan fault poisons (under pp: a stage's part)
        self.step = 0
        self.skipped = 0
        self.verdict: dict[str, Any] | None = None  # what the loop reports after the step
        self.late: dict[str, Any] | None = None  # the previous step's spike, judged late (on_spike = log)
        self.pending: tuple[Any, torch.Tensor, int] | None = None  # (work, summed loss, step): on_spike = log

    def arm(self, step: int) -> None:
        """Step ``step`` is about to run: set the injected nan fault (tests) on this rank's
        forward, so its loss and, through backward and the gradient reduction, every rank's
        gradients turn non-finite, as a real overflow does."""
        self.step = step
        if faults.nan_now(self.rank, step):

            def poison(_module: nn.Module, _args: Any, out: Any) -> Any:
                hook.remove()
                return _nan_like(out)

            hook = self.forward_module.register_forward_hook(poison)

    def after_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Apply the injected spike fault (tests); returns the loss the step reports."""
        if faults.spike_now(self.step):
            loss = loss * faults.SPIKE_FACTOR
        return loss

    def allow_update(self, loss: torch.Tensor, grad_norm: torch.Tensor, global_loss: float | None) -> bool:
        """Whether the optimizer may step; a refusal (or a logged spike) leaves its reason in ``verdict``."""
        self.verdict, self.late = None, self._judge_pending()
        if not math.isfinite(float(grad_norm)):
            found = diagnose(self.model, loss, grad_norm, self.rank, self.distributed)
            return self._refuse("nonfinite", self.cfg.on_nonfinite, found)
        if self.spikes is None:
            return True
        if global_loss is None:
            summed = loss.detach().float().sum().reshape(1)
            if self.distributed and self.cfg.on_spike == "log":
                self.pending = (dist.all_reduce(summed, async_op=True), summed, self.step)
                return True
            if self.distributed:
                dist.all_reduce(summed)
            global_loss = float(summed) * self.loss_scale
        found = self._spike(global_loss)
        if found is None:
            return True
        if self.cfg.on_spike == "log":
            self.verdict = {"event": "loss_spike", "step": self.step, "action": "log", "lag": 0, **found}
            return True
        return self._refuse("loss_spike", self.cfg.on_spike, found)

    def _spike(self, global_loss: float) -> dict[str, Any] | None:
        assert self.spikes is not None
        median = self.spikes.median()
        score = self.spikes.check(global_loss)
        return None if score is None else {"loss": global_loss, "median": median, "score": round(score, 2)}

    def _judge_pending(self) -> dict[str, Any] | None:
        """The previous step's asynchronous loss reduce (on_spike = log): wait, then judge it."""
        if self.pending is None:
            return None
        work, summed, step = self.pending
        self.pending = None
        work.wait()
        found = self._spike(float(summed) * self.loss_scale)
        if found is None:
            return None
        return {"event": "loss_spike", "step": step, "action": "log", "lag": self.step - step, **found}

    def _refuse(self, event: str, action: str, found: dict[str, Any]) -> bool:
        self.skipped += 1
        if self.skipped > self.cfg.max_skipped:
            action = "stop"
            found["reason"] = f"more than health.max_skipped = {self.cfg.max_skipped} bad steps"
        self.verdict = {"event": event, "step": self.step, "action": action, **found}
        return False


def _nan_like(out: Any) -> Any:
    """The module's output (a tensor, or a tuple led by one) times NaN."""
    if isinstance(out, tuple):
        return (out[0] * float("nan"), *out[1:])
    return out * float("nan")
