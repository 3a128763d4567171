"""One optimizer step: a plain runner (micro-batches with gradient accumulation) and a
pipeline runner (the schedule runs the micro-batches), sharing one finish.

The finish is the same for both: put gradients in their parameters' layouts (tp without
FSDP), clip by the global norm (its all-reduce is part of the computation), step the
optimizer and the LR schedule, drop the gradients. Measurement is asked for per step
(``measure``): only then is the loss reduced over the ranks and read, and are the state
bytes counted. Otherwise the loss stays a device tensor on this rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from meshforge.config.run_plan import RunPlan
from meshforge.health.guard import StepGuard
from meshforge.metrics.memory import gathered_param_bytes, host_state_bytes, state_bytes
from meshforge.metrics.step_result import StepResult
from meshforge.models.documents import Documents
from meshforge.models.loss import LanguageModelLoss
from meshforge.parallel.compile import compile_loss
from meshforge.parallel.context.ring import cp_index
from meshforge.parallel.data.apply import gradient_sync
from meshforge.parallel.fp8 import precompute_fp8_scales
from meshforge.parallel.grad_clip import clip_grad_norm
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.pipeline.runtime import Pipeline
from meshforge.parallel.tensor.apply import local_value, match_grad_layouts
from meshforge.train.optimizer import current_lr
from meshforge.train.packing import Packing


class StepRunner:
    """The shared finish; subclasses run forward and backward over this rank's batch slice."""

    loss_groups: tuple[dist.ProcessGroup | None, ...] = ()  # groups the loss is summed over before dp
    guard: StepGuard | None = None  # health: asked before each update (health/guard.py)
    stage_group: dist.ProcessGroup | None = None  # pipeline: ranks with disjoint parameters
    replicas: Any = None  # fault tolerance: averages gradients with the other replica groups, commits or not

    def __init__(
        self,
        plan: RunPlan,
        mesh: Mesh,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LambdaLR,
        loss: LanguageModelLoss,
        eos_id: int | None = None,
    ):
        """``model``: this rank's parameters; ``eos_id``: the corpus's end-of-text token, where
        packed documents end (train/packing.py)."""
        self.model, self.optimizer, self.scheduler, self.loss = model, optimizer, scheduler, loss
        lay = plan.layout
        self.mesh, self.sharded, self.dp_cp = mesh, plan.fsdp, lay.dp_cp
        self.pre_update: Callable[[], None] | None = None
        self.max_norm = plan.train.grad_clip or float("inf")
        self.offload = lay.offload == "cpu"
        self.match_layouts = lay.tp > 1 and not plan.fsdp
        self.fp8_scales = plan.fp8_all_gather  # fp8 all-gather: weight scales precomputed per step
        # once per run; under cp, this rank's token index (its slice of inputs, targets, positions)
        self.cp_index = cp_index(plan.train.seq_len, mesh, lay)
        self.packing = Packing(plan, eos_id, mesh.device, self.cp_index)  # positions, and documents per batch
        # the loss as one compiled call (parallel/compile.py); under tp its loss-parallel DTensors stay eager
        self.loss_fn = compile_loss(loss) if plan.train.compile and lay.tp == 1 else loss

    def run(self, batch: torch.Tensor, measure: bool, documents: Documents | None = None) -> StepResult:
        """Forward/backward over this rank's slice ``batch`` (sequences of seq_len + 1 tokens), then one
        update. ``documents``: the batch's packed documents (``Packing.documents``), None when off."""
        lr = current_lr(self.scheduler)
        if self.fp8_scales:  # before the forward, not after the update: a rollback, a resume or a
            precompute_fp8_scales(self.model)  # DiLoCo sync changes weights in between too
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.cp_index is not None:
            inputs, targets = inputs[:, self.cp_index], targets[:, self.cp_index]
        loss, gathered = self.forward_backward(inputs, targets, measure, documents)
        if self.guard:
            loss = self.guard.after_backward(loss)
        out = StepResult(loss, torch.zeros(()), lr, measure)
        if documents is not None and self.packing.mask:  # the attention work the mask left (host numbers)
            out.attention_span = documents.span()
        global_loss = self.reduce_loss(loss) if measure else None
        if self.match_layouts:
            match_grad_layouts(self.model)
        if self.pre_update is not None:  # DiLoCo's warm-up: gradients averaged over the islands
            self.pre_update()
        if self.replicas is not None:  # parallel/fault_tolerance: over the live groups, then commit or not
            out.committed, global_loss = self.replicas.sync(loss if global_loss is None else global_loss)
            out.replicas = self.replicas.participants
            out.lr = current_lr(self.scheduler)  # (a group that healed in this step: at the healed step)
            if not out.committed:  # nothing applied: the trainer takes this step again
                self.optimizer.zero_grad(set_to_none=True)
                return out
        if measure:
            out.global_loss = float(global_loss)
        own_clip = getattr(self.optimizer, "clip_grad_norm", None)  # bf16 ZeRO-1 clips its reduced shard
        if own_clip is not None:
            out.grad_norm = own_clip(self.max_norm)
        else:
            out.grad_norm = clip_grad_norm(self.model.parameters(), self.max_norm, self.stage_group)
        if self.guard is None or self.guard.allow_update(loss, out.grad_norm, out.global_loss):
            self.optimizer.step()
        else:
            out.skipped = True
        if measure:
            out.state_mem = {**state_bytes(self.model, self.optimizer), "gathered_params": gathered}
            if self.offload:
                out.state_mem_host = host_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return out

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, measure: bool, documents: Documents | None
    ) -> tuple[torch.Tensor, int]:
        """Accumulate this rank's gradients; return its loss and (measured, sharded) the
        bytes of parameters held gathered for backward."""
        raise NotImplementedError

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global-batch loss from every rank's share (any shape: summed elementwise).
        A collective: every rank calls it at the same point."""
        total = loss.detach().clone()
        for group in self.loss_groups:
            dist.all_reduce(total, group=group)
        if self.dp_cp > 1:  # cp ranks hold equal token counts: their mean losses average like dp's
            dist.all_reduce(total, group=self.mesh.loss_group)
            total /= self.dp_cp
        return total


class PlainStep(StepRunner):
    """Micro-batches with gradient accumulation; DDP / FSDP reduce gradients on the last one
    (or on every one with parallel.sync_every_microbatch)."""

    def __init__(
        self,
        plan: RunPlan,
        mesh: Mesh,
        *,
        train_model: nn.Module,
        forward_context: Callable[[], contextlib.AbstractContextManager],
        **common: Any,
    ):
        """``train_model``: what the forward calls (the model, or its DDP wrapper); ``forward_context``:
        what wraps it (parallelize.forward_context); ``common``: the StepRunner's."""
        super().__init__(plan, mesh, **common)
        self.train_model, self.forward_context = train_model, forward_context
        self.micro, self.accum = plan.batch.micro, plan.batch.count  # the plan's one split of the batch
        self.sync_all = plan.layout.sync_every_microbatch

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, measure: bool, documents: Documents | None
    ) -> tuple[torch.Tensor, int]:
        total = torch.zeros((), device=self.mesh.device)
        gathered = 0
        for i in range(self.accum):
            sl = slice(i * self.micro, (i + 1) * self.micro)
            last = i == self.accum - 1
            with gradient_sync(self.train_model, last or self.sync_all), self.loss.context():
                args = self.packing.forward_args(documents, sl.start, sl.stop)
                with self.forward_context():
                    logits = self.train_model(inputs[sl], **args)
                loss = self.loss_fn(logits, targets[sl], self.model)
                if measure and last and self.sharded:
                    gathered = gathered_param_bytes(self.model)  # what ZeRO-2 keeps gathered for backward
                (loss / self.accum).backward()
            total += local_value(loss.detach())
        return total / self.accum, gathered


class PipelineStep(StepRunner):
    """The schedule runs the micro-batches; the loss is known on the last stage (summed over
    the pp group to share it), the gradient norm adds up over the stages."""

    def __init__(self, plan: RunPlan, mesh: Mesh, *, pipeline: Pipeline, **common: Any):
        super().__init__(plan, mesh, **common)
        self.pipeline = pipeline
        self.loss_groups = (self.mesh.group("pp"),)
        self.stage_group = self.mesh.group("pp")

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, measure: bool, documents: Documents | None
    ) -> tuple[torch.Tensor, int]:
        # the one spot every stage takes its micro-batch's positions and documents from
        self.pipeline.forward_args = lambda start, stop: self.packing.forward_args(documents, start, stop)
        return self.pipeline.step(inputs, targets, self.mesh.rank, measure), 0
