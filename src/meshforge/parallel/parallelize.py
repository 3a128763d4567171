"""This rank's model, built for the run plan's layout: the one place that composes
parallelism, in a fixed order:

PP split -> fp8 -> TP/SP -> EP -> CP -> activation checkpointing -> compile -> FSDP/DDP.

``build_rank_model`` is the trainer's entry: the model on the meta device, parallelized,
materialised and initialised from train.seed (model.init_from is loaded over it by the
trainer: checkpoint/weights.py). ``build_loss`` is the run's one loss object, with the
vocab-parallel head loss (parallel/tensor/vocab_loss.py) installed under tp, and
``forward_context`` what wraps a forward pass.

The order matters: fp8 swaps linears for torchao's Float8Linear before TP shards their
weights (as torchtitan converts before parallelizing; converted after TP, its casts meet
DTensor weights with plain-tensor scales and fail), checkpointing must wrap the (possibly sharded) block, compile must
see the checkpointed block, and data parallelism goes last so its hooks see the final
parameters. The model arrives on the meta device and is materialised here, after
sharding, so a rank only ever allocates its own shards; every shard is filled from the
seed-determined full values, so any layout starts from the single-process weights.
With pp > 1 the model is first split into pipeline chunks (parallel/pipeline/runtime.py) and each
chunk then goes through the same steps as a whole model. Context parallelism swaps each
block's attention core for ring attention (parallel/context/ring.py) and makes MoE
balance losses count the whole micro-batch (parallel/context/moe.py); its parameters
are replicated over cp, so data parallelism reduces over dp x cp. Expert parallelism splits
each MoE layer's experts over ep data-parallel ranks and swaps its dispatcher for an
all-to-all one (parallel/expert/dispatch.py); FSDP then shards the experts over the
remaining (edp) ranks and everything else as usual. Under tp an MoE block's router runs
replicated over tp and each tp rank dispatches its share of the slots
(parallel/tensor/moe.py).

With tp > 1 every parameter is a DTensor on the tp mesh, which DDP does not take; the
data-parallel stages then all run on FSDP2: stages 2/3 shard over dp as usual, and stage
0 is FSDP2 on a (dp, 1) mesh, i.e. replicated parameters with gradients all-reduced per
block during backward (DDP's semantics, with one extra parameter copy for FSDP2's
gathered buffer).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshforge.config.run_plan import RunPlan
from meshforge.models.chunked_loss import chunked_cross_entropy
from meshforge.models.llama import Transformer, build_model, init_weights
from meshforge.models.loss import LanguageModelLoss
from meshforge.parallel.activation_checkpoint import apply_activation_checkpoint
from meshforge.parallel.compile import compile_blocks
from meshforge.parallel.context.moe import apply_moe_cp
from meshforge.parallel.context.ring import apply_cp
from meshforge.parallel.data.apply import apply_ddp, apply_fsdp, fill_param, param_region
from meshforge.parallel.expert.dispatch import apply_ep, shard_experts
from meshforge.parallel.fp8 import apply_fp8
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.pipeline.runtime import Pipeline
from meshforge.parallel.pipeline.schedules import chunks_per_rank, schedule_name
from meshforge.parallel.pipeline.split import balanced_split, chunk_ranks, give_positions, model_view, split_model
from meshforge.parallel.precision import autocast
from meshforge.parallel.tensor.apply import apply_tp, loss_context
from meshforge.parallel.tensor.moe import split_over_tp
from meshforge.parallel.tensor.vocab_loss import vocab_parallel_cross_entropy


@dataclass
class RankModel:
    """What ``build_rank_model`` gives the trainer."""

    model: nn.Module  # the parameters this rank holds, under the whole model's names
    train_model: nn.Module  # what the step calls (model itself, or its DDP wrapper)
    pipeline: Pipeline | None  # pp > 1: the schedule over this rank's chunks


def build_rank_model(plan: RunPlan, mesh: Mesh, loss: LanguageModelLoss) -> RankModel:
    """This rank's part of the plan's model: built on the meta device, parallelized (a pipeline's
    last stage computes ``loss``), materialised and initialised from train.seed."""
    model = build_model(plan.shape, device="meta")
    if plan.layout.pp > 1:  # model: this rank's chunks, under the whole model's names
        model, pipeline = parallelize_pipeline(model, plan, mesh, seed=plan.train.seed, loss=loss)
        return RankModel(model, model, pipeline)
    return RankModel(model, parallelize(model, plan, mesh, seed=plan.train.seed), None)


def build_loss(plan: RunPlan) -> LanguageModelLoss:
    """The one loss object of a run (plain step, pipeline's last stage, evaluation); under
    tensor parallelism its context is loss_parallel, over vocab-sharded logits, and its chunked
    head loss the vocab-parallel one. With train.loss_chunk_size the head runs in the loss, in
    bf16 where the layout autocasts."""
    tp = plan.layout.tp > 1
    return LanguageModelLoss(
        context=functools.partial(loss_context, tp),
        loss_chunk_size=plan.train.loss_chunk_size,
        compute_dtype=torch.bfloat16 if plan.autocast else None,  # else: the hidden states' dtype
        head_loss=vocab_parallel_cross_entropy if tp else chunked_cross_entropy,
    )


def forward_context(plan: RunPlan, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """What wraps a forward pass: bf16 autocast where the plan uses it, else nothing."""
    if not plan.autocast:
        return contextlib.nullcontext
    return functools.partial(autocast, device, plan.train.precision)


def _apply(model: Transformer, plan: RunPlan, mesh: Mesh, seed: int | None) -> None:
    """fp8 -> TP/SP -> EP -> CP -> AC -> compile -> FSDP on one (whole or pipeline-stage) model,
    then materialise and initialise it."""
    blocks = list(model.layers.values())
    t, lay = plan.train, plan.layout
    model.hidden_out = t.loss_chunk_size > 0  # the loss applies the head (build_loss)
    if t.precision == "fp8":
        apply_fp8(model, t.fp8_recipe, list(t.fp8_exclude), mesh.device, plan.fp8_all_gather)
    if lay.tp > 1:
        apply_tp(model, mesh.submesh("tp"), lay.sequence_parallel, plan.async_tp)
    if lay.ep > 1:
        apply_ep(model, mesh, lay)
        if lay.tp > 1:  # each tp rank dispatches its share of the slots
            split_over_tp(model, mesh.group("tp"))
    if lay.cp > 1:
        apply_cp(model, mesh, lay)
        apply_moe_cp(model, mesh.group("cp"))
    apply_activation_checkpoint(blocks, lay.activation_checkpoint)
    if t.compile:  # whole blocks (fullgraph) where they hold (parallel/compile.py)
        compile_blocks(blocks)
    if plan.fsdp:
        param_dtype = torch.bfloat16 if t.precision in ("bf16", "fp8") else None
        if lay.ep > 1:  # the experts' own units (over edp) first, then the blocks around them
            shard_experts(model, mesh, lay, param_dtype)
        apply_fsdp(model, mesh, lay, param_dtype)
    offload = plan.fsdp and lay.offload == "cpu"  # sharded state in host memory, buffers on the device
    model.to_empty(device="cpu" if offload else mesh.device)
    if not plan.fsdp:
        model.tie_weights()
    if seed is not None:
        init_weights(model, seed, fill=fill_param, region=param_region)
    if offload:
        for mod in model.modules():
            for name, buf in mod.named_buffers(recurse=False):
                mod.register_buffer(name, buf.to(mesh.device), persistent=name not in mod._non_persistent_buffers_set)


def parallelize(model: Transformer, plan: RunPlan, mesh: Mesh, seed: int | None) -> nn.Module:
    """Apply the plan's layout (pp = 1) to a meta-device model, materialise it on the mesh's
    device and initialise it from ``seed`` (None: leave it for a state-dict load). Returns the
    module to train (``model`` itself, or a DDP wrapper around it)."""
    _apply(model, plan, mesh, seed)
    if plan.ddp:  # (bf16 ZeRO-1 reduces in its optimizer; FSDP2 in its hooks)
        return apply_ddp(model, mesh, plan.layout.ddp_bucket_mb)
    return model


def parallelize_pipeline(
    model: Transformer, plan: RunPlan, mesh: Mesh, seed: int | None, loss: LanguageModelLoss
) -> tuple[nn.Module, Pipeline]:
    """pp > 1: split the meta-device model into chunks, keep this rank's, apply the other
    axes to each chunk as to a whole model, and build the schedule (its last stage computes
    ``loss``). Returns a module over this rank's chunks with the whole model's parameter
    names, and the pipeline."""
    lay = plan.layout
    pp, name = lay.pp, schedule_name(lay.pp_schedule)
    v = chunks_per_rank(name, lay.pp_virtual_stages)
    sizes = list(lay.pp_layers) or balanced_split(model.shape, plan.train.seq_len, pp * v)
    owner = chunk_ranks(pp, v, name)
    mine = [c for c in range(pp * v) if owner[c] == mesh.coordinate("pp")]
    parts = split_model(model, sizes, mine)
    pipe: Pipeline | None = None  # built below; the hooks read the arguments its runner sets per step
    for part, c in zip(parts, mine, strict=True):
        give_positions(part, lambda: pipe.stage_args(), None if c == 0 else plan.train.seq_len)
        _apply(part, plan, mesh, seed)
    pipe = Pipeline(parts, mine, mesh, lay, loss)
    return model_view(parts), pipe
