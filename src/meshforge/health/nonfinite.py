"""Where a non-finite value came from: asked only after the step's flag said there is one.

The good path has no collective (see guard.py); this bad path gathers from every rank
whether its loss and its own gradients are finite, and the first parameter (in the model's
order) whose local gradient is not. A rank's loss comes from its own data before any
reduction, so the ranks with a non-finite loss are where it started; gradients are
reduced, so by now every rank may hold the NaN.
"""

from __future__ import annotations

import math
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def first_nonfinite_param(model: nn.Module) -> str | None:
    """The name of the first parameter whose (local) gradient holds a NaN or an infinity."""
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
            return name
    return None


def rank_findings(model: nn.Module, loss: torch.Tensor, rank: int) -> dict[str, Any]:
    """This rank's side of a non-finite step."""
    value = float(_local(loss).detach().float().sum())
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "loss_finite": math.isfinite(value),
        "param": first_nonfinite_param(model),
    }


def diagnose(model: nn.Module, loss: torch.Tensor, grad_norm: torch.Tensor, rank: int, distributed: bool) -> dict:
    """The ``nonfinite`` event's fields, gathered from every rank (a collective: all ranks call it)."""
    mine = rank_findings(model, loss, rank)
    found = [mine]
    if distributed:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    bad_loss = [f["rank"] for f in found if not f["loss_finite"]]
    bad_grad = [f["rank"] for f in found if f["param"] is not None]
    where = (["loss"] if bad_loss else []) + (["grad_norm"] if not math.isfinite(float(grad_norm)) or bad_grad else [])
    first = next((f for f in found if f["param"] is not None), None)
    return {
        "ranks": bad_loss or bad_grad,  # the origin: a reduction spreads gradients, not losses
        "where": where or ["flag"],
        "loss_ranks": bad_loss,
        "grad_ranks": bad_grad,
        "param": first["param"] if first else None,
        "param_rank": first["rank"] if first else None,
        "hosts": sorted({f["host"] for f in found if f["rank"] in set(bad_loss) | set(bad_grad)}),
    }
