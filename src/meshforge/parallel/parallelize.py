"""The one place that composes parallelism, in a fixed order:

PP split -> fp8 -> TP/SP -> EP -> CP -> activation checkpointing -> compile -> FSDP/DDP.

The order matters: fp8 swaps linears for torchao's Float8Linear before TP shards their
weights (as torchtitan converts before parallelizing; converted after TP, its casts meet
DTensor weights with plain-tensor scales and fail), checkpointing must wrap the (possibly sharded) block, compile must
see the checkpointed block, and data parallelism goes last so its hooks see the final
parameters. The model arrives on the meta device and is materialised here, after
sharding, so a rank only ever allocates its own shards; every shard is filled from the
seed-determined full values, so any layout starts from the single-process weights.
With pp > 1 the model is first split into pipeline chunks (parallel/pipeline.py) and each
chunk then goes through the same steps as a whole model. Context parallelism swaps each
block's attention core for ring attention (parallel/context_parallel.py) and makes MoE
balance losses count the whole micro-batch (parallel/moe_context_parallel.py); its parameters
are replicated over cp, so data parallelism reduces over dp x cp. Expert parallelism splits
each MoE layer's experts over ep data-parallel ranks and swaps its dispatcher for an
all-to-all one (parallel/expert_parallel.py); FSDP then shards the experts over the
remaining (edp) ranks and everything else as usual. Under tp an MoE block's router runs
replicated over tp and each tp rank dispatches its share of the slots
(parallel/moe_tensor_parallel.py).

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
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshforge.compat import split_backward_through_custom_functions
from meshforge.models.llama import Transformer, init_weights
from meshforge.models.loss import LanguageModelLoss
from meshforge.parallel.activation_checkpoint import apply_activation_checkpoint
from meshforge.parallel.compile import compile_blocks
from meshforge.parallel.context_parallel import apply_cp
from meshforge.parallel.data_parallel import apply_ddp, apply_fsdp, fill_param, param_region
from meshforge.parallel.dims import casts_once, gathers_weights
from meshforge.parallel.expert_parallel import apply_ep, shard_experts
from meshforge.parallel.fp8 import apply_fp8, fp8_all_gather
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.moe_context_parallel import apply_moe_cp
from meshforge.parallel.moe_tensor_parallel import split_over_tp
from meshforge.parallel.pipeline import (
    Pipeline,
    balanced_split,
    chunk_ranks,
    give_positions,
    model_view,
    split_model,
)
from meshforge.parallel.precision import autocast, resolve_mixed_precision, resolve_precision
from meshforge.parallel.schedules import SPLIT_BACKWARD, chunks_per_rank, schedule_name
from meshforge.parallel.tensor_parallel import apply_tp, loss_context
from meshforge.parallel.zero1 import uses_flat_zero1

if TYPE_CHECKING:
    from meshforge.config import Config


def is_sharded(cfg: Config, mesh: Mesh) -> bool:
    """Data parallelism runs on FSDP2 (the rules are the layout's: Layout.uses_fsdp, and
    dims.casts_once for a world of one and DDP's layouts in bf16, and a world of one offloading)."""
    precision = resolve_precision(cfg.train.precision, mesh.device)
    mixed = resolve_mixed_precision(cfg.train.mixed_precision, mesh.device)
    return mesh.dims.uses_fsdp() or casts_once(mesh.dims, precision, mixed)


def uses_autocast(cfg: Config, mesh: Mesh) -> bool:
    """bf16 comes from autocast, except under FSDP2, whose mixed-precision policy casts the
    gathered parameters to bf16 (and reduces gradients in fp32) instead."""
    return cfg.train.precision in ("bf16", "fp8") and not is_sharded(cfg, mesh)


def gathers_fp8(cfg: Config, mesh: Mesh) -> bool:
    """fp8 runs whose FSDP2 all-gathers weights in fp8 (parallel/fp8.py: fp8_all_gather); their
    step precomputes the weights' scales before each forward (train/step.py). Not under CPU
    offload: the sharded weights live in host memory, where the scales' all-reduce cannot run."""
    if cfg.train.precision != "fp8" or cfg.parallel.offload == "cpu":
        return False
    return fp8_all_gather(cfg.train.fp8_recipe, mesh.device, is_sharded(cfg, mesh) and gathers_weights(mesh.dims))


def build_loss(cfg: Config, mesh: Mesh) -> LanguageModelLoss:
    """The one loss object of a run (plain step, pipeline's last stage, evaluation); under
    tensor parallelism its context is loss_parallel, over vocab-sharded logits. With
    train.loss_chunk_size the head runs in the loss, in bf16 where the layout autocasts."""
    return LanguageModelLoss(
        context=functools.partial(loss_context, mesh.degrees["tp"] > 1),
        chunk_size=loss_chunk_size(cfg),
        compute_dtype=torch.bfloat16 if uses_autocast(cfg, mesh) else None,  # else: the hidden states' dtype
    )


def loss_chunk_size(cfg: Config) -> int:
    """train.loss_chunk_size, or 0 (the full-logits loss) for a zero-bubble schedule on a torch
    whose weight pass cannot cross the chunked loss's autograd.Function (compat.py)."""
    split = cfg.parallel.pp > 1 and schedule_name(cfg.parallel.pp_schedule) in SPLIT_BACKWARD
    return 0 if split and not split_backward_through_custom_functions() else cfg.train.loss_chunk_size


def forward_context(cfg: Config, mesh: Mesh) -> Callable[[], contextlib.AbstractContextManager]:
    """What wraps a forward pass: bf16 autocast where the layout uses it (see uses_autocast), else nothing."""
    if not uses_autocast(cfg, mesh):
        return contextlib.nullcontext
    return functools.partial(autocast, mesh.device, resolve_precision(cfg.train.precision, mesh.device))


def _apply(model: Transformer, cfg: Config, mesh: Mesh, seed: int | None) -> bool:
    """fp8 -> TP/SP -> CP -> AC -> compile -> FSDP on one (whole or pipeline-stage) model, then
    materialise and initialise it. Returns whether it is FSDP-sharded."""
    blocks = list(model.layers.values())
    model.hidden_out = loss_chunk_size(cfg) > 0  # the loss applies the head (build_loss)
    if cfg.train.precision == "fp8":
        apply_fp8(model, cfg.train.fp8_recipe, cfg.train.fp8_exclude, mesh.device, gathers_fp8(cfg, mesh))
    if mesh.degrees["tp"] > 1:
        apply_tp(model, mesh.submesh("tp"), cfg.parallel.sequence_parallel)
    if mesh.dims.ep > 1:
        apply_ep(model, mesh)
        if mesh.degrees["tp"] > 1:  # each tp rank dispatches its share of the slots
            split_over_tp(model, mesh.group("tp"))
    if mesh.degrees["cp"] > 1:
        apply_cp(model, mesh, cfg)
        apply_moe_cp(model, mesh.group("cp"))
    apply_activation_checkpoint(blocks, cfg.train.activation_checkpoint)
    if cfg.train.compile:  # whole blocks (fullgraph) where they hold (parallel/compile.py)
        compile_blocks(blocks)
    sharded = is_sharded(cfg, mesh)
    if sharded:
        param_dtype = torch.bfloat16 if cfg.train.precision in ("bf16", "fp8") else None
        if mesh.dims.ep > 1:  # the experts' own units (over edp) first, then the blocks around them
            shard_experts(model, mesh, cfg.parallel.zero_stage, param_dtype)
        apply_fsdp(model, mesh, cfg.parallel.zero_stage, param_dtype, offload=cfg.parallel.offload == "cpu")
    offload = sharded and cfg.parallel.offload == "cpu"  # sharded state in host memory, buffers on the device
    model.to_empty(device="cpu" if offload else mesh.device)
    if not sharded:
        model.tie_weights()
    if seed is not None:
        init_weights(model, seed, fill=fill_param, region=param_region)
    if offload:
        for mod in model.modules():
            for name, buf in mod.named_buffers(recurse=False):
                mod.register_buffer(name, buf.to(mesh.device), persistent=name not in mod._non_persistent_buffers_set)
    return sharded


def parallelize(model: Transformer, cfg: Config, mesh: Mesh, seed: int | None) -> nn.Module:
    """Apply the configured layout (pp = 1) to a meta-device model, materialise it on the
    mesh's device and initialise it from ``seed`` (None: leave it for a state-dict load).
    Returns the module to train (``model`` itself, or a DDP wrapper around it)."""
    sharded = _apply(model, cfg, mesh, seed)
    precision = resolve_precision(cfg.train.precision, mesh.device)
    flat_zero1 = uses_flat_zero1(precision, cfg.parallel.zero_stage, mesh.dims.dp_cp)
    if mesh.dims.dp_cp > 1 and not sharded and not flat_zero1:  # (bf16 ZeRO-1 reduces in its optimizer)
        return apply_ddp(model, mesh, cfg.parallel.ddp_bucket_mb)
    return model


def parallelize_pipeline(
    model: Transformer, cfg: Config, mesh: Mesh, seed: int | None, loss: LanguageModelLoss
) -> tuple[nn.Module, Pipeline]:
    """pp > 1: split the meta-device model into chunks, keep this rank's, apply the other
    axes to each chunk as to a whole model, and build the schedule (its last stage computes
    ``loss``). Returns a module over this rank's chunks with the whole model's parameter
    names, and the pipeline."""
    p = cfg.parallel
    pp, name = mesh.dims.pp, schedule_name(p.pp_schedule)
    v = chunks_per_rank(name, p.pp_virtual_stages)
    sizes = list(p.pp_layers) or balanced_split(model.args, cfg.train.seq_len, pp * v)
    owner = chunk_ranks(pp, v, name)
    mine = [c for c in range(pp * v) if owner[c] == mesh.coordinate("pp")]
    parts = split_model(model, sizes, mine)
    pipe: Pipeline | None = None  # built below; the hooks read the positions its runner sets per step
    for part, c in zip(parts, mine, strict=True):
        give_positions(part, lambda: pipe.positions, None if c == 0 else cfg.train.seq_len)
        _apply(part, cfg, mesh, seed)
    pipe = Pipeline(parts, mine, cfg, mesh, loss)
    return model_view(parts), pipe
