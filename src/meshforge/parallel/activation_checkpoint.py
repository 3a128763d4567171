"""Activation checkpointing per transformer block, keeping parameter names unchanged.

full: keep only each block's input; recompute the whole block in backward.
selective: keep matmul outputs, recompute the rest (attention core, norms, activations)
— the cheap-to-recompute, memory-heavy part that Korthikanti et al. single out.
The block's forward is replaced in place instead of wrapping it in another module, so
state-dict keys (and so checkpoints and HF export) are the same with or without it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshforge.parallel.tensor import async_tp

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    # under tensor parallelism, keep the (sequence-sharded, small) reduced outputs rather than
    # repeat a collective; the all-gather in front of a column layer is redone in backward,
    # as Megatron-LM does, since its output is the full sequence
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    # async TP's overlapped ops (their outputs: the projections, with the gathered input they
    # keep for backward, and the reduced sequence shard): kept, so no ring runs again in backward
    async_tp.all_gather_matmul._opoverload,
    async_tp.matmul_reduce_scatter._opoverload,
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpoint(blocks: list[nn.Module], mode: str) -> None:
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation_checkpoint mode {mode!r}")
    for block in blocks:
        inner = block.forward
        if mode == "full":
            ctx = None
        else:
            ctx = functools.partial(create_selective_checkpoint_contexts, _policy)

        def forward(*args, _inner=inner, _ctx=ctx, **kwargs):
            if _ctx is None:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=_ctx, **kwargs)

        block.forward = forward
