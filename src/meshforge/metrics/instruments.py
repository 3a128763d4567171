"""What measures the steps from outside: the profiler (profile.start_step / profile.steps),
the step clock behind the time breakdown of logged steps, and the optional W&B sink.
The trainer calls ``before_step`` / ``after_step`` around every step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshforge.config import to_dict
from meshforge.config.run_plan import RunPlan
from meshforge.metrics.profiler import StepProfiler
from meshforge.metrics.sinks import MetricsLogger
from meshforge.metrics.step_metrics import StepMetrics
from meshforge.metrics.time_breakdown import StepClock
from meshforge.metrics.wandb_sink import WandbSink
from meshforge.parallel.comm_stats import CommCounter
from meshforge.parallel.mesh import Mesh


class StepInstruments:
    def __init__(
        self,
        plan: RunPlan,
        mesh: Mesh,
        *,
        first_forward: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        comm: CommCounter | None,
        logger: MetricsLogger | None,
        metrics: StepMetrics,
        event: Callable[..., None],
        say: Callable[[str], None],
    ):
        """``first_forward``: where a step's data time ends; ``comm``: the step measures' counter;
        ``logger``, ``metrics``, ``event``, ``say``: the run log's."""
        self.mesh, self.event, self.say = mesh, event, say
        run_dir = Path(plan.run.dir)
        self.profiler = StepProfiler(plan.profile, mesh.rank, mesh.device, run_dir, plan.train.steps)
        self.clock = StepClock(first_forward, optimizer, comm, mesh.device)
        metrics.breakdown = self.breakdown
        if plan.metrics.wandb and logger:
            logger.add_sink(WandbSink(run_dir, to_dict(plan.config)))

    def before_step(self, n: int, t0: float, measured: bool) -> None:
        """Step ``n`` (1-based) starts at ``t0``."""
        self.profiler.before(n)
        self.clock.start(t0, measured=measured)

    def after_step(self, n: int) -> None:
        self.clock.stop()
        tracing = self.profiler.prof is not None
        self.profiler.after(n)
        if tracing and self.profiler.prof is None:
            self.event("profile", dir=str(self.profiler.dir), first=self.profiler.first, last=n)
            self.say(f"profile: traces of steps {self.profiler.first}-{n} in {self.profiler.dir} (open in Perfetto)")

    def close(self) -> None:
        self.profiler.close()

    def breakdown(self, pp_stats: dict[str, Any]) -> dict[str, Any]:
        """The last logged step's time breakdown (a gather: every rank calls it)."""
        return self.clock.breakdown(pp_stats.get("bubble_fraction", 0.0), self.mesh.distributed)
