"""Auxiliary losses (MoE balance and router z-losses) of pipeline stages that do not compute the loss.

Only the last stage calls the loss object, which adds the auxiliary terms its own layers
reported. The MoE blocks of earlier stages report theirs too, and in the single-process run
those terms are part of each micro-batch's loss. To give the router weights of an earlier
stage the same gradient, a forward hook on that stage drains the terms its layers reported
(``models/loss.py``) and ties their sum to the stage's output with ``_AddAuxGrad``: an
identity on the activation whose backward also hands the sum a gradient of 1, the gradient
the term gets as a summand of the micro-batch's loss. The schedule then divides every
stage's gradients by the number of micro-batches, as it does for the last stage's loss, so
the gradients equal the single-process mean over the batch.

The detached values are summed over the step's micro-batches on the device (no sync); the
step runner reads their mean per micro-batch after the schedule ran, for logging.

On its first step, torch's schedule infers the stages' shapes by running a real forward and
backward (the first micro-batch on stage 0, stand-in tensors after it) and calling the loss.
``forget_metadata_inference`` drops what that run counted -- the loss object's parts, the
MoE load and drops, the earlier stages' auxiliary terms -- when it ends, before the step's
micro-batches run (so nothing real has been counted yet).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshforge.models.loss import LanguageModelLoss, drain_aux
from meshforge.models.moe import moe_layers


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``h``; in backward, ``aux`` receives a gradient of 1 (see the module docstring).
    The output is a copy, not a view: the zero-bubble schedules detach stage outputs in place,
    which views refuse (the original, saved by nothing, is freed)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return h.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_like
        return g, torch.ones(shape, dtype=dtype, device=device)


class StageAux:
    """The auxiliary terms of this rank's stages before the last: their gradient enters in
    the stage's backward; their values add up per step for logging."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def attach(self, part: nn.Module) -> None:
        """Carry the terms ``part``'s layers report into its backward (a stage that is not the last)."""
        part.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        aux = drain_aux(module)
        if not aux:  # evaluation, or a stage without MoE blocks
            return output
        for k, v in aux.items():
            self.sums[k] = self.sums[k] + v.detach() if k in self.sums else v.detach()
        return _AddAuxGrad.apply(output, sum(aux.values()))

    def take(self, microbatches: int) -> dict[str, torch.Tensor]:
        """The step's terms as means per micro-batch (summed over this rank's stages); starts afresh."""
        out = {k: v / microbatches for k, v in self.sums.items()}
        self.sums = {}
        return out


def forget_metadata_inference(stage: Any, loss: LanguageModelLoss, aux: StageAux) -> None:
    """After the schedule's shape inference on ``stage`` (see the module docstring), zero what it
    counted. Hooks the stage's private cleanup method, wrapped here only; a PyTorch without
    it runs no such inference."""
    cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
    if cleanup is None:
        return

    def run() -> None:
        cleanup()
        loss.discard()
        aux.sums = {}
        drain_aux(stage.submod)
        for moe in moe_layers(stage.submod).values():
            moe.load.zero_()
            moe.drops.zero_()

    stage._post_metadata_inference_cleanup = run
