"""Mixture-of-experts blocks under tensor parallelism: attention and dense layers stay
tensor-parallel (parallel/tensor/apply.py), the routed experts are expert-parallel.

What an MoE block sees on each tp rank: the block's input is gathered to the whole
micro-batch first (under sequence parallelism an all-gather of the sequence shards, as in
front of a dense feed-forward; without it every tp rank already holds the same tokens), so
the router runs replicated on every tp rank over exactly the tokens one device would see.
Routing, capacity, the balance losses and the expert load are then those of the
single-process micro-batch, with no extra communication, and the balance bias moves the
same way on every rank.

Only the routed experts' work is split: of the slots routed to each expert, tp rank t
takes the t-th of tp equal shares (``share_rows``) and sends those -- and only those -- through
the expert-parallel dispatch (its ep group holds ranks of the same tp coordinate). Outputs
of the other shares are zeros, and one all-reduce over tp (Megatron's "g") gives every rank
all slots' outputs; the gradient of the slots' inputs is all-reduced the same way in
backward ("f"). The expert weights are replicated over tp (sharded over ep, and by FSDP
over edp), each tp rank computing on other slots, so their gradients are partial sums over
tp: ``sum_over_tp`` adds them after FSDP's reduce-scatter (parallel/expert/dispatch.py).

The router's weight is a replicated DTensor read locally (its computation is replicated,
so is its gradient); shared experts are a dense SwiGLU and are Megatron column/row
parallel, replicated in and out. The block's output is sliced back to this rank's
sequence shard (sequence parallelism) or stays replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from meshforge.models.moe import GroupedExperts, moe_layers


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over tp (each rank's is partial)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) forward of per-rank partial outputs; identity backward (the
    gradient of the replicated result is already whole on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def share_rows(counts: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of rows sorted by expert (``counts[e]`` rows of expert e), the t-th of tp equal
    shares of every expert's rows: their row indices and the per-expert counts."""
    starts = torch.cumsum(counts, 0) - counts
    lo, hi = counts * rank // tp, counts * (rank + 1) // tp
    mine = hi - lo
    offset = starts + lo - (torch.cumsum(mine, 0) - mine)  # row index - position among the kept
    total = int(mine.sum())
    rows = torch.repeat_interleave(offset, mine, output_size=total) + torch.arange(total, device=counts.device)
    return rows, mine


class TensorParallelSplit(nn.Module):
    """The MoE dispatcher under tp: this rank's share of each expert's slots goes through
    ``inner`` (the expert-parallel dispatch); all slots' outputs come back on every rank."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.inner, self.group = inner, group
        self.rank, self.tp = dist.get_rank(group), dist.get_world_size(group)

    @property
    def elem_bytes(self) -> int:  # read by train/moe_stats.py for the all-to-all formula
        return self.inner.elem_bytes

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        rows, mine = share_rows(counts, self.rank, self.tp)
        out = self.inner(x[rows], mine, experts)
        full = out.new_zeros((x.shape[0], *out.shape[1:])).index_copy(0, rows, out)
        return _SumOverTP.apply(full, self.group)


class ReplicatedParams(ParallelStyle):
    """A module's parameters become replicated DTensors on the tp mesh, its forward untouched
    (the MoE reads the router weight's local value; see ``local_weight``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


def moe_block_plan(sequence_parallel: bool, shared: bool) -> dict[str, ParallelStyle]:
    """The feed-forward entries of an MoE block (the attention entries are the dense block's)."""
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(act,),
            desired_input_layouts=(Replicate(),),  # SP: all-gather the sequence shards
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(act,),  # SP: keep this rank's sequence shard (backward: all-gather)
            use_local_output=True,
        ),
        "feed_forward.router": ReplicatedParams(),
    }
    if shared:
        plan["feed_forward.shared.w1"] = ColwiseParallel()
        plan["feed_forward.shared.w3"] = ColwiseParallel()
        plan["feed_forward.shared.w2"] = RowwiseParallel()
    return plan


def is_moe_plan_key(key: str) -> bool:
    """Dense feed-forward entries of the block plan, which an MoE block replaces."""
    return key == "feed_forward" or key.startswith("feed_forward.")


def apply_moe_tp(block: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Tensor-parallel plan of one MoE block's feed-forward (see the module docstring)."""
    moe = block.feed_forward
    parallelize_module(block, tp_mesh, moe_block_plan(sequence_parallel, moe.shared is not None))


def split_over_tp(model: nn.Module, tp_group: dist.ProcessGroup) -> None:
    """Wrap every MoE layer's (expert-parallel) dispatcher so that each tp rank runs its share."""
    for moe in moe_layers(model).values():
        moe.dispatcher = TensorParallelSplit(moe.dispatcher, tp_group)


def sum_over_tp(group: dist.ProcessGroup) -> Any:
    """FSDP all-reduce hook: add the tp ranks' partial expert gradients (after the reduce-scatter)."""

    def hook(grad: torch.Tensor) -> None:
        dist.all_reduce(grad, group=group)

    return hook
