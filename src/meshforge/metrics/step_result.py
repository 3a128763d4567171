"""What one optimizer step leaves for the records: the step runner (train/step.py) fills it,
the step metrics, the health guard and the run log read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    """What a step leaves: device tensors always, host values only on measured steps."""

    loss: torch.Tensor  # this rank's share of the loss, not reduced (see StepRunner.reduce_loss)
    grad_norm: torch.Tensor  # the global pre-clip norm, equal on every rank
    lr: float  # the LR this step used
    measured: bool
    global_loss: float | None = None  # measured: the loss over the whole global batch
    state_mem: dict[str, int] | None = None  # measured: bytes of params, grads, optimizer state, gathered params
    state_mem_host: dict[str, int] | None = None  # measured, under CPU offload: the part of state_mem in host memory
    skipped: bool = False  # the health guard refused the update (its loss stays out of the summary's)
    committed: bool = True  # fault tolerance: False when the replica groups did not commit the step (taken again)
    replicas: int | None = None  # fault tolerance: the live replica groups in this step
    attention_span: float | None = None  # packed documents masked: keys per query as a full-square count (else seq)
