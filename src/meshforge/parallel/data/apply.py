"""The data-parallel family, chosen by ``parallel.zero_stage`` and the two dp degrees.

Per rank, for Ψ parameters and N data-parallel ranks (fp32 master weights, Adam):

| stage | how                                             | params        | grads  | Adam m, v |
|-------|-------------------------------------------------|---------------|--------|-----------|
| 0     | DDP: bucketed all-reduce overlapping backward    | 4Ψ            | 4Ψ     | 8Ψ        |
| 1     | DDP + ZeroRedundancyOptimizer                    | 4Ψ            | 4Ψ     | 8Ψ/N      |
| 2     | FSDP2, parameters kept gathered fwd -> bwd       | 4Ψ/N (+ gathered copy during the step) | 4Ψ/N | 8Ψ/N |
| 3     | FSDP2, resharded after forward, per-block units  | 4Ψ/N          | 4Ψ/N   | 8Ψ/N      |

HSDP (dp_replicate > 1, stages 2/3) shards over ``dp_shard`` inside a group and
replicates across groups: FSDP2 on the 2-D (dp_replicate, dp_shard) mesh.

Under context parallelism (cp > 1) the cp ranks hold the same parameters and see other
tokens of the same sequences, so they join the reduction: DDP and ZeRO-1 run over
``dp_cp``, FSDP2 shards over ``dp_shard_cp`` (HSDP: the 2-D (dp_replicate, dp_shard_cp)
mesh); the mean over dp x cp equal-sized token sets is the global mean.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # private: used here only
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset,
)  # private: here and tensor/vocab_loss.py
from torch.nn.parallel import DistributedDataParallel

from meshforge.config.layout import Layout
from meshforge.parallel.data.zero1 import FlatZero1
from meshforge.parallel.mesh import Mesh


def apply_ddp(model: nn.Module, mesh: Mesh, bucket_cap_mb: int = 25) -> nn.Module:
    """Stages 0 and 1: DDP over the flattened ``dp`` group (``dp_cp`` under cp > 1);
    gradients arrive averaged.

    The default all-reduce comm hook is registered explicitly: it does what DDP does
    built in, but through torch.distributed's Python API, so the communication counter
    (comm_stats.py) sees the bytes.
    """
    group = mesh.loss_group
    ddp = DistributedDataParallel(
        model,
        process_group=group,
        device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
    )
    ddp.register_comm_hook(group, allreduce_hook)
    return ddp


class AllReduceScatter(ReduceScatter):
    """Reduce-scatter as an in-place all-reduce of FSDP's flat input, keeping the local chunk.

    Used on gloo only: gloo's reduce-scatter is far slower than its ring all-reduce (30 MB
    on this 2-core machine: 51 vs 30 ms with 2 ranks, 239 vs 72 ms with 4), so moving
    twice the bytes this way is faster. NCCL keeps the native reduce-scatter.
    """

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        dist.all_reduce(input_tensor, op=op, group=group)
        n = output_tensor.numel()
        r = dist.get_rank(group)
        output_tensor.view(-1).copy_(input_tensor.view(-1)[r * n : (r + 1) * n])
        return None


def _fsdp_mesh(mesh: Mesh, lay: Layout) -> DeviceMesh:
    """The mesh FSDP2 shards over: (dp, cp) replicated for stage 0, (dp_replicate, dp_shard x cp)
    for HSDP, dp_shard x cp otherwise; a world of one's one-rank mesh."""
    if mesh.device_mesh is None:
        return mesh.solo_mesh()
    if lay.zero_stage < 2:
        return mesh.slice(("dp", "cp"))
    shard = "dp_shard_cp" if lay.cp > 1 else "dp_shard"
    if lay.dp_replicate > 1:  # HSDP: shard within a group (its cp ranks too), replicate across
        return mesh.slice(("dp_replicate", shard))
    return mesh.slice((shard,))


def apply_fsdp(model: nn.Module, mesh: Mesh, lay: Layout, param_dtype: torch.dtype | None) -> nn.Module:
    """Stages 2 and 3 (and HSDP): FSDP2 ``fully_shard`` per block, then the rest.

    The embedding and the final norm + head get units of their own (unless tied), so the
    root holds no parameters and stage 3 keeps nothing gathered between forward and
    backward. Each block prefetches the next block's all-gather in forward.

    Stage 0 (only reached under tensor parallelism, where DDP cannot take DTensors) is
    FSDP2 on the 2-D mesh (dp, cp) with cp = 1: replicate over all of dp, "shard" over one
    rank, which is DDP's all-reduce of gradients.

    A world of one runs on a one-rank mesh (Mesh.solo_mesh): FSDP2 then only casts (bf16
    parameters once per micro-batch, fp32 gradients) and, with CPU offload, keeps the state on
    the host. DDP's layouts in bf16 (stage 0) are the (dp, cp) replicate case above.

    ``parallel.offload = "cpu"``: FSDP2's CPUOffloadPolicy keeps the sharded parameters and gradients in
    (pinned) host memory and the optimizer steps there; each unit's parameters are copied to
    the device for its all-gather (ZeRO-Infinity's idea, host memory only).
    """
    fsdp_mesh = _fsdp_mesh(mesh, lay)
    # Under TP the embedding unit returns a view; the model never changes it in place, which
    # is what FSDP2's warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = lay.zero_stage == 3  # (stage 0 on a one-rank shard has nothing to reshard)
    kw = dict(mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    if lay.offload == "cpu":  # (pinning needs a GPU; a CPU run only offloads in tests)
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device.type == "cuda")
    blocks = list(model.layers.values())
    units: list[FSDPModule] = []
    tied = getattr(model.shape, "tie_embeddings", False)
    if not tied and model.tok_embeddings is not None:  # (a pipeline stage may lack it, or the head)
        units.append(fully_shard(model.tok_embeddings, **kw))
    for block in blocks:
        units.append(fully_shard(block, **kw))
    if not tied and model.output is not None:
        fully_shard([model.norm, model.output], **kw)  # one unit; returns the list, so keep a member
        units.append(model.norm)
    # a tied head is in the root unit; when the loss applies it after the forward (chunked loss,
    # hidden_out) the root stays gathered until backward, as FSDP2 keeps a root by default
    root_kw = {**kw, "reshard_after_forward": False} if tied and getattr(model, "hidden_out", False) else kw
    fully_shard(model, **root_kw)
    for cur, nxt in zip(units, units[1:], strict=False):
        cur.set_modules_to_forward_prefetch([nxt])
    if dist.get_backend(fsdp_mesh.get_group(fsdp_mesh.ndim - 1)) == "gloo":
        for unit in (*units, model):
            unit.set_custom_reduce_scatter(AllReduceScatter())
    return model


def make_optimizer(
    groups: list[dict],
    cls: type[torch.optim.Optimizer],
    kwargs: dict,
    mesh: Mesh,
    lay: Layout,
    flat_zero1: bool = False,
    microbatches: int = 1,
) -> torch.optim.Optimizer:
    """Stage 1 shards the optimizer over the mesh's loss group (dp, or dp x cp: cp ranks hold
    the same parameters and gradients, so they share the state like dp ranks); sharded stages
    shard it through their params. ``flat_zero1`` (the run plan's bf16 stage 1) holds bf16
    working state and shards fp32 master + Adam (parallel/data/zero1.py), reducing its gradients
    (in parallel.grad_reduce_dtype) bucket by bucket during the last of ``microbatches`` backward passes."""
    group = mesh.loss_group
    if flat_zero1:
        dtype, bucket_mb = lay.grad_reduce_dtype, lay.ddp_bucket_mb
        return FlatZero1(groups, cls, kwargs, group, dtype, bucket_mb=bucket_mb, microbatches=microbatches)
    if lay.zero_stage == 1 and lay.dp_cp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # ZeRO-1 (fp32) runs only: ~0.5 CPU-s to import

        zero = ZeroRedundancyOptimizer(
            groups[0]["params"],
            optimizer_class=cls,
            process_group=group,
            weight_decay=groups[0]["weight_decay"],
            **kwargs,
        )
        for g in groups[1:]:
            zero.add_param_group(g)
        return zero
    return cls(groups, **kwargs)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient reduction of a non-final micro-batch (DDP no_sync / FSDP2 flag)."""
    if isinstance(model, DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def param_region(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, local shape): the box of the full tensor this rank's shard of ``p`` holds, so that
    init_weights draws only those values; None where it holds all of it or no box (a strided
    shard of FSDP over tp rows): the full tensor is drawn and ``fill_param`` keeps the shard."""
    if not isinstance(p, DTensor) or any(type(pl) not in (Shard, Replicate) for pl in p.placements):
        return None
    local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offset), tuple(local)


def fill_param(p: torch.Tensor, values: torch.Tensor) -> None:
    """Copy a parameter's values (its whole tensor, or the box ``param_region`` names) into it,
    a DTensor shard or not (no communication: every rank draws the same values from the seed)."""
    if isinstance(p, DTensor):
        if tuple(values.shape) != tuple(p.shape):  # this rank's box already
            p.to_local().copy_(values)
            return
        local = distribute_tensor(values.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(values)


def replica_group(mesh: Mesh, lay: Layout, fsdp: bool) -> dist.ProcessGroup | None:
    """The ranks that hold this rank's parameter shards bit-identical after every step (health/sdc.py
    compares them): under FSDP2 the HSDP replicate groups (dp_replicate), else every data-parallel
    (and cp) rank of this island, which all hold whole replicas; None where nothing is replicated."""
    if not mesh.distributed:
        return None
    if fsdp:
        return mesh.group("dp_replicate") if lay.dp_replicate > 1 else None
    return mesh.loss_group if lay.dp_cp > 1 else None
