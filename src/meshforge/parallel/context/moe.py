"""Mixture-of-experts balance under context parallelism.

Routing is per token, so under cp each rank routes the tokens of its sequence shards as one
device would. The load-balance loss E * sum_i f_i * P_i is not per token: f_i (the share of
the micro-batch's routed slots that went to expert i) and P_i (the mean router probability
of expert i) are taken over the whole micro-batch. P_i is a mean over tokens, and every cp
rank holds the same number of them, so the mean over the cp ranks of each rank's local P_i
is the micro-batch's; the loss is linear in P, and the cp ranks' losses (and gradients) are
averaged like data-parallel ones. So it is enough to give every rank the micro-batch's f_i:
its per-expert slot counts summed over the cp group (E integers per MoE layer and
micro-batch, no gradient). The router z-loss is a mean over tokens and needs nothing.
Capacity is not run under cp (parallel/rules.py refuses it): it would drop per shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshforge.models.moe import moe_layers


class SequenceShardCounts(nn.Module):
    """The micro-batch's slots per expert: this rank's counts summed over the cp group."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        total = counts.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total


def apply_moe_cp(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Every MoE layer's balance loss counts the slots of the whole micro-batch (see above)."""
    for moe in moe_layers(model).values():
        moe.balance_counts = SequenceShardCounts(group)
