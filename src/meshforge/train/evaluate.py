"""Validation loss, the same number under every layout.

The sequences are spread evenly over the whole validation split (not its first block),
and the set is a whole number of global batches split contiguously over the data-parallel
ranks, so every layout evaluates the same sequences. The loss is the run's loss object's
summed token loss (the language model alone, no auxiliary terms).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from meshforge.config.run_plan import RunPlan
from meshforge.data.dataset import TokenSplit
from meshforge.models.documents import Documents
from meshforge.models.loss import LanguageModelLoss
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.pipeline.runtime import Pipeline
from meshforge.parallel.tensor.apply import local_value
from meshforge.train.packing import Packing


class Evaluator:
    """Mean validation loss over train.eval_batches global batches' worth of sequences."""

    def __init__(
        self,
        val: TokenSplit,
        plan: RunPlan,
        mesh: Mesh,
        *,
        model: nn.Module,
        loss: LanguageModelLoss,
        forward_context: Callable[[], contextlib.AbstractContextManager],
        pipeline: Pipeline | None,
        packing: Packing,
    ):
        """``model``, ``loss``, ``forward_context``, ``pipeline`` (None without one) and ``packing``
        (positions and packed documents) are the step runner's, so evaluation computes as training does."""
        self.val, self.plan, self.mesh, self.model, self.loss = val, plan, mesh, model, loss
        self.forward_context, self.pipeline, self.packing = forward_context, pipeline, packing
        self.cp_index = packing.cp_index  # under cp: this rank's tokens of each sequence

    def _batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, Documents | None]:
        """Inputs and targets of these validation sequences (under cp, this rank's tokens) and their documents."""
        host = self.val.get(indices)
        docs = self.packing.documents(host)
        batch = host.to(self.mesh.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.cp_index is not None:
            inputs, targets = inputs[:, self.cp_index], targets[:, self.cp_index]
        return inputs, targets, docs

    def _mine(self) -> tuple[np.ndarray, int]:
        """This dp rank's sequence indices, and the number of sequences over all ranks."""
        B = self.plan.train.global_batch_size
        n = min(self.plan.train.eval_batches * B, len(self.val) // B * B)
        if n == 0:
            return np.zeros(0, dtype=np.int64), 0
        chosen = np.arange(n, dtype=np.int64) * len(self.val) // n
        per = n // self.plan.layout.dp
        return chosen[self.mesh.dp_rank * per : (self.mesh.dp_rank + 1) * per], n

    @torch.no_grad()
    def __call__(self) -> float | None:
        """The mean token loss (None when the validation split is smaller than a global batch).
        A collective: every rank calls it."""
        mine, n = self._mine()
        if n == 0:
            return None
        total = torch.zeros((), device=self.mesh.device, dtype=torch.float64)
        batch = self.plan.batch  # per dp rank: the whole slice (a pipeline's), one micro-batch (else)
        if self.pipeline:  # whole per-rank batches through the schedule, forward only
            for s in range(0, len(mine), batch.local):
                inputs, targets, docs = self._batch(mine[s : s + batch.local])
                self.pipeline.forward_args = lambda a, b, d=docs: self.packing.forward_args(d, a, b)
                total += self.pipeline.eval_loss(inputs, targets)
            dist.all_reduce(total, group=self.mesh.group("pp"))
        else:
            for s in range(0, len(mine), batch.micro):
                inputs, targets, docs = self._batch(mine[s : s + batch.micro])
                with self.forward_context():
                    logits = self.model(inputs, **self.packing.forward_args(docs, 0, inputs.shape[0]))
                with self.loss.context():
                    loss = self.loss.token_sum(logits, targets, self.model)
                total += local_value(loss).double()
        if self.mesh.distributed:
            # token sums: over dp x cp every token of the n sequences is counted once
            dist.all_reduce(total, group=self.mesh.loss_group)
        return float(total) / (n * self.plan.train.seq_len)
