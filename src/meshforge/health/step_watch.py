"""What the loop calls around every step: the health keeper (detectors and what they do),
the profiler (profile.start_step / profile.steps) and the time breakdown of logged steps.
One object so the loop stays a loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from meshforge.config import to_dict
from meshforge.health.keeper import HealthKeeper
from meshforge.health.trainer_view import TrainerView
from meshforge.metrics.profiler import StepProfiler
from meshforge.metrics.time_breakdown import StepClock
from meshforge.metrics.wandb_sink import WandbSink


class StepWatch:
    def __init__(self, trainer: TrainerView):
        self.t = trainer
        cfg, mesh = trainer.cfg, trainer.mesh
        self.health = HealthKeeper(trainer)
        self.profiler = StepProfiler(cfg.profile, mesh.rank, mesh.device, Path(cfg.run.dir), cfg.train.steps)
        self.clock = StepClock(first_forward(trainer), trainer.optimizer, trainer.comm, mesh.device)
        trainer.metrics.breakdown = self.breakdown
        if cfg.metrics.wandb and trainer.logger:
            trainer.logger.add_sink(WandbSink(Path(cfg.run.dir), to_dict(cfg.config)))

    def before_step(self, n: int) -> float:
        """Step ``n`` (1-based) starts; returns its start time."""
        self.profiler.before(n)
        t0 = self.health.before_step(n)
        self.clock.start(t0, measured=self.health.logged)
        return t0

    def after_step(self, n: int) -> bool:
        """Step ``n`` is done; True when a health action went back to a checkpoint."""
        self.clock.stop()
        tracing = self.profiler.prof is not None
        self.profiler.after(n)
        if tracing and self.profiler.prof is None:
            self.t.event("profile", dir=str(self.profiler.dir), first=self.profiler.first, last=n)
            self.t.say(f"profile: traces of steps {self.profiler.first}-{n} in {self.profiler.dir} (open in Perfetto)")
        return self.health.after_step(n)

    def close(self) -> None:
        self.health.close()
        self.profiler.close()

    def breakdown(self, pp_stats: dict[str, Any]) -> dict[str, Any]:
        """The last logged step's time breakdown (a gather: every rank calls it)."""
        return self.clock.breakdown(pp_stats.get("bubble_fraction", 0.0), self.t.mesh.distributed)


def first_forward(trainer: TrainerView) -> list[nn.Module]:
    """Where a step's data time ends: the model's forward, or under pp the first stage's part
    (a later stage's first forward waits for the pipeline to fill: that is bubble, not data)."""
    pipe = trainer.pipeline
    if pipe is None:
        return [trainer.model]
    return [pipe.parts[pipe.chunks.index(0)]] if pipe.has_first else []
