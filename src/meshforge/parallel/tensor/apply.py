"""Tensor parallelism (Megatron-LM column/row) with sequence parallelism, on the ``tp`` mesh dimension.

Per block, as in Megatron-LM:

- attention: ``wq``, ``wk``, ``wv`` column-parallel, so each rank owns heads/tp query heads
  and kv_heads/tp key/value heads (whole heads: attention itself needs no communication);
  ``wo`` row-parallel;
- feed-forward: ``w1`` and ``w3`` column-parallel, ``w2`` row-parallel.

A column layer's output is exactly the row layer's input shard, so the only collective
in a sub-layer is the one that sums the row layer's partial outputs: one per sub-layer
in forward, and its mirror image (in the column layer's input gradient) in backward.

Without sequence parallelism (SP) that collective is an all-reduce and the norms and
residual adds run replicated on the full sequence. With SP (``parallel.sequence_parallel``,
on by default) the all-reduce is split into its two halves: a reduce-scatter leaves each
rank 1/tp of the sequence, where the norm and residual run (1/tp of their activation
memory), and an all-gather rebuilds the full sequence in front of the next column layer.
Same bytes on the wire, less memory.

The embedding is vocab-parallel (each rank holds vocab/tp rows; tokens outside its range
give zeros and the partial sums are reduced); the head is column-parallel over the
vocabulary and the loss is computed on those shards (``loss_parallel``), so the full
b x s x vocab logits are never gathered. With ``train.loss_chunk_size`` the head runs inside
the chunked loss, one chunk of tokens at a time, its log-sum-exp all-reduced over tp.

DTensor's ``parallelize_module`` styles cover all of this; this file only says which
style goes where. Async TP (``parallel.async_tp``) keeps the same shards and swaps each block's
projection seams for ones that overlap the all-gather and reduce-scatter with the GEMMs beside
them (parallel/tensor/async_tp.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from meshforge import compat
from meshforge.models.llama import HeadProjection, Transformer
from meshforge.models.moe import MoE
from meshforge.parallel.tensor.async_tp import AllGatherMatmul, AllGatherMatmulHead, MatmulReduceScatter
from meshforge.parallel.tensor.moe import apply_moe_tp, is_moe_plan_key


class ReplicateParallel(ParallelStyle):
    """A module run whole on every tp rank, its parameters replicated DTensors.

    Without SP the norms see the full (replicated) activations; their weights still become
    DTensors so that every parameter of a TP model is one, which the foreach optimizer
    and the state-dict helpers need. Inputs and outputs stay plain tensors.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


class VocabParallelHead(ColwiseParallel):
    """The head: column-parallel over the vocabulary. Its output is the vocab-sharded logits
    (a DTensor, for loss_parallel), or, when the chunked loss calls it with ``loss_fn``
    (models/chunked_loss.py), that loss's plain replicated value, passed through."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class EmbeddingParallel(RowwiseParallel):
    """The vocab-parallel embedding: RowwiseParallel whose reduction waits before it hands its
    output on. RowwiseParallel's own is asynchronous, and the lazily-waited tensor it returns,
    fed to a compiled block, reaches the reduction's backward as a plain tensor (torch 2.13:
    "'Tensor' object has no attribute '_local_tensor'"), so tp + train.compile failed."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron layout of one transformer block, keyed by submodule name.

    The attention and feed-forward inputs become one replicated DTensor shared by their
    column layers, so backward sums the column layers' input gradients first and then
    reduces once (Megatron's "f" operator); letting each column layer convert its own
    input would reduce three times in attention and twice in the feed-forward.
    """
    seq, full = Shard(1), Replicate()
    act = seq if sequence_parallel else full
    norm = SequenceParallel if sequence_parallel else ReplicateParallel
    return {
        "attention_norm": norm(),
        # SP: all-gather the normed sequence shards once, in front of the three column layers
        "attention": PrepareModuleInput(input_layouts=(act, None, None), desired_input_layouts=(full, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),  # SP: reduce-scatter; else all-reduce
        "ffn_norm": norm(),
        "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(full,)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=act),
    }


class ShardedWeight(ParallelStyle):
    """Only the linear's weight sharded over tp (``Shard(dim)``), its forward untouched: under
    async TP the block's seams multiply with the local shard themselves (async_tp.py)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(self.dim)])))

        return distribute_module(module, device_mesh, partition_fn=shard)


def async_block_plan() -> dict[str, ParallelStyle]:
    """Async TP (sequence parallelism only): the same weight shards as ``block_plan``, the norms
    hand their sequence shard on as a plain tensor, and the seams do the collectives (``swap_seams``)."""
    norm = SequenceParallel(use_local_output=True)
    col, row = ShardedWeight(0), ShardedWeight(1)
    return {
        "attention_norm": norm,
        **{f"attention.{w}": col for w in ("wq", "wk", "wv")},
        "attention.wo": row,
        "ffn_norm": norm,
        "feed_forward.w1": col,
        "feed_forward.w3": col,
        "feed_forward.w2": row,
    }


def swap_seams(module: nn.Module, group: dist.ProcessGroup, transport: str) -> None:
    """Attention's (or a dense MLP's) ``project_in`` / ``project_out`` become the overlapped ones."""
    module.project_in = AllGatherMatmul(group, transport)
    module.project_out = MatmulReduceScatter(group, transport)


def overlapped_head(model: nn.Module) -> bool:
    """Whether async TP can swap the head's seam: the model's own bias-free head (an fp8 head is
    another class, and a pipeline stage without the head has none)."""
    head = getattr(model, "output", None)
    return isinstance(getattr(head, "project", None), HeadProjection) and head.bias is None


def outer_plan(sequence_parallel: bool, overlapped: bool = False) -> dict[str, ParallelStyle]:
    """Embedding, final norm and head. The head keeps its vocab-sharded logits as a
    DTensor (``use_local_output=False``) for the loss-parallel cross-entropy; the chunked
    loss instead reduces its log-sum-exp over the tp group itself. ``overlapped`` (async TP):
    the head's input stays sequence-sharded, its ``project`` seam gathers it while multiplying
    (``swap_head_seam``), and the chunked loss gathers it itself (models/chunked_loss.py)."""
    act = Shard(1) if sequence_parallel else Replicate()
    head = VocabParallelHead(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
    if overlapped:
        head.desired_input_layouts = (act,)
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": EmbeddingParallel(input_layouts=Replicate(), output_layouts=act),
        "output": head,
    }
    plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    return plan


def _present(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries whose module this model has (a pipeline stage lacks the embedding or the head)."""
    return {k: v for k, v in plan.items() if getattr(model, k.split(".")[0], None) is not None}


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, async_tp: str = "off") -> None:
    """Shard ``model`` (usually still on the meta device) over ``tp_mesh`` in place.

    A tied head shares the embedding's table: both are sharded on the vocab dimension
    (rows of the embedding, output features of the head), so after sharding the head is
    re-pointed at the embedding's DTensor and the two stay one parameter. A block with a
    mixture-of-experts feed-forward keeps the attention entries and takes its feed-forward's
    plan from parallel/tensor/moe.py.

    ``async_tp`` (the run plan's decision): ``ring`` / ``symm_mem`` swap every block's
    attention and dense MLP, and the head, for the overlapped seams (async_tp.py; an MoE
    feed-forward keeps its own plan, the vocab-parallel embedding its reduce-scatter: a lookup
    has no GEMM to hide it under); ``micro_pipeline`` keeps this plan and lets inductor fuse it
    (CUDA, compiled).
    """
    overlapped = async_tp in ("ring", "symm_mem")
    head = overlapped and overlapped_head(model)
    parallelize_module(model, tp_mesh, _present(model, outer_plan(sequence_parallel, head)))
    if head:
        model.output.project = AllGatherMatmulHead(tp_mesh, async_tp)
    plan = async_block_plan() if overlapped else block_plan(sequence_parallel)
    attention_only = {k: v for k, v in plan.items() if not is_moe_plan_key(k)}
    if async_tp == "micro_pipeline":
        compat.enable_micro_pipeline_tp(tp_mesh.get_group())
    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoE)
        parallelize_module(block, tp_mesh, attention_only if moe else plan)
        if moe:
            apply_moe_tp(block, tp_mesh, sequence_parallel)
        if overlapped:
            for module in (block.attention,) if moe else (block.attention, block.feed_forward):
                swap_seams(module, tp_mesh.get_group(), async_tp)
    model.tie_weights()


def loss_context(tp: bool) -> contextlib.AbstractContextManager:
    """Around the loss and its backward: cross-entropy on vocab-sharded logits under TP."""
    return loss_parallel() if tp else contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (a plain tensor passes through)."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def match_grad_layouts(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's layout, once per step before clipping.

    Under sequence parallelism a norm weight's gradient comes out of backward as a partial
    sum over the sequence shards (one small all-reduce fixes it), and the vocab-parallel
    embedding's comes out replicated (taking this rank's rows is free). FSDP2 does the
    same itself when it reduces gradients; this covers tp without data parallelism.
    """
    for p in model.parameters():
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)
