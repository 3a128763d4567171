"""What a measured step gathers beyond its result: the communication it made (counted per
axis while it runs), the pipeline's bubble and in-flight counts, the MoE figures, and once
per run the pipeline's Gantt chart. All of it reduces or gathers over ranks, so it runs on
measured steps only (logged, last, or the Gantt step): the same steps on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.config.run_plan import RunPlan
from meshforge.models.loss import LanguageModelLoss
from meshforge.parallel.comm_stats import CommCounter
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.pipeline.runtime import Pipeline
from meshforge.train.moe_stats import moe_record
from meshforge.train.pipeline_stats import gather_pipeline_stats, write_gantt


class StepMeasures:
    def __init__(
        self,
        plan: RunPlan,
        mesh: Mesh,
        *,
        model: nn.Module,
        loss: LanguageModelLoss,
        pipeline: Pipeline | None,
        reduce_loss: Callable[[torch.Tensor], torch.Tensor],
        event: Callable[..., None],
    ):
        """``model``: this rank's parameters; ``pipeline``: None without one; ``reduce_loss``: the
        step runner's; ``event``: the run log's."""
        self.plan, self.mesh, self.reduce_loss, self.event = plan, mesh, reduce_loss, event
        self.model, self.loss, self.pipeline = model, loss, pipeline
        self.comm = CommCounter(mesh.groups_by_axis()) if mesh.distributed else None
        self.gantt_step = min(3, plan.train.steps) if self.pipeline else 0  # past the first steps' warm-up
        self.tokens_per_rank = plan.batch.local * plan.train.seq_len // plan.layout.cp
        self.extra: dict[str, Any] = {}
        self.spans: list[float] = []  # packed documents: each step's attention span since the last measured step

    def wanted(self, n: int, logged: bool, last: bool) -> bool:
        """Whether step ``n`` is measured (every rank agrees: the same steps everywhere)."""
        return logged or last or n == self.gantt_step

    @contextlib.contextmanager
    def counting(self, measure: bool) -> Iterator[None]:
        """Count the collectives of a measured step (nothing is wrapped on other steps)."""
        with self.comm.counting() if self.comm and measure else contextlib.nullcontext():
            yield

    def add_span(self, span: float | None) -> None:
        """Book a step's attention span (``StepResult.attention_span``; None: unmasked)."""
        if span is not None:
            self.spans.append(span)

    def _span(self) -> float | None:
        """The mean attention span of the steps since the last measured one, over every rank's
        sequences (one all-reduce: ranks holding the same sequences hold the same value)."""
        if not self.spans:
            return None
        mean = torch.tensor(sum(self.spans) / len(self.spans), dtype=torch.float64, device=self.mesh.device)
        self.spans = []
        if self.mesh.distributed:
            dist.all_reduce(mean)
            mean /= self.mesh.world_size
        return float(mean)

    def take(self) -> dict[str, Any]:
        """The measured step's figures (collectives: every rank calls it)."""
        span = self._span()
        pp_stats = gather_pipeline_stats(self.pipeline, self.mesh) if self.pipeline else {}
        plan = self.plan
        moe = moe_record(
            self.model, self.loss, self.mesh, plan.layout, self.reduce_loss, plan.shape, self.tokens_per_rank
        )
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        comm = self.comm.snapshot() if self.comm else {}
        self.extra = {"comm_bytes_by_kind": comm, "pp_stats": pp_stats, "moe": moe, "attention_span": span}
        return self.extra

    def gantt(self, step: int) -> None:
        """At the Gantt step (measured), the pipeline's timeline of that step to rank 0's run dir."""
        if self.pipeline and step == self.gantt_step:
            bubble = self.extra["pp_stats"]["bubble_fraction"]
            write_gantt(self.pipeline, self.mesh, step, bubble, Path(self.plan.run.dir), self.event)
