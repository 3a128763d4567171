"""What the trainer's parts (health checks, the step watch) read and set on the Trainer.

A Protocol, so those parts are typed without importing train/loop.py, which imports them;
the types themselves are imported for the type checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim.lr_scheduler import LambdaLR

    from meshforge.checkpoint.run_checkpoints import RunCheckpoints
    from meshforge.config import Config
    from meshforge.data.dataset import TokenDataset
    from meshforge.metrics.sinks import MetricsLogger
    from meshforge.metrics.step_metrics import StepMetrics
    from meshforge.metrics.time_breakdown import PhaseTimer
    from meshforge.models.shape import ModelShape
    from meshforge.parallel.comm_stats import CommCounter
    from meshforge.parallel.mesh import Mesh
    from meshforge.parallel.pipeline.runtime import Pipeline
    from meshforge.train.state import TrainState
    from meshforge.train.step import PipelineStep, PlainStep


class TrainerView(Protocol):
    cfg: Config
    mesh: Mesh
    device: torch.device
    model: nn.Module  # under pp a view over this rank's stage parts (forward runs the parts)
    pipeline: Pipeline | None
    runner: PlainStep | PipelineStep
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    state: TrainState
    checkpoints: RunCheckpoints
    metrics: StepMetrics
    logger: MetricsLogger | None
    comm: CommCounter | None
    # read by train/run_records.py (the run's announcement, step records and summary)
    args: ModelShape
    precision: str
    peak: float
    data: TokenDataset
    micro: int
    accum: int
    phases: PhaseTimer
    comm_bytes: dict[str, dict[str, float]]
    pp_stats: dict[str, Any]
    moe_stats: dict[str, Any]

    def event(self, name: str, **fields: Any) -> None: ...

    def say(self, text: str) -> None: ...

    def reposition_schedule(self) -> None: ...
