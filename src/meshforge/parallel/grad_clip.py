"""Global gradient-norm clipping over any mix of plain and DTensor gradients.

``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, which fails when plain
tensors (replicated norms without sequence parallelism, DDP) and DTensors (TP and FSDP
shards) meet, and would do one collective per tensor if it did not. Here each gradient's
squared norm is summed locally, grouped by the mesh dimensions it is sharded over, and
each group is reduced once over exactly those dimensions: a Shard dimension holds a
piece of the tensor (sum the pieces), a Replicate dimension holds a copy (count it once).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _sharded_dims(g: DTensor) -> tuple:
    """(mesh, mesh dims) that hold pieces of ``g``; a Partial gradient is reduced first."""
    if any(p.is_partial() for p in g.placements):
        raise ValueError("a Partial gradient reached clipping; reduce it when it is accumulated")
    # not is_shard(): FSDP over a tp-sharded dimension uses _StridedShard, which is not a Shard
    return g.device_mesh, tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.dtype].append(t)
    return list(out.values())


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor], max_norm: float, stage_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm`` (inf: only
    measure). Returns the pre-clip norm as a plain fp32 scalar, equal on every rank.

    ``stage_group``: the pipeline group, whose ranks hold disjoint parameters (their
    squared norms add up)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and stage_group is None:
        return torch.zeros(())
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor):
            mesh, dims = _sharded_dims(g)
            groups[(id(mesh), dims)].append(g)
        else:
            groups[(None, ())].append(g)
    device = (grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]).device if grads else None
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_, dims), members in groups.items():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in members]
        sq = torch.stack([n.float() for n in torch._foreach_norm(local)]).square().sum()
        if dims:
            mesh = members[0].device_mesh
            for d in dims:
                dist.all_reduce(sq, group=mesh.get_group(d))
        total += sq
    if stage_group is not None:
        dist.all_reduce(total, group=stage_group)
    norm = total.sqrt()
    if max_norm != float("inf") and grads:
        # a non-finite norm leaves the gradients as they are (NaN would poison them all),
        # so health checks can still name the parameter it came from
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).nan_to_num(1.0, posinf=1.0, neginf=1.0)
        for dtype_group in _by_dtype([g.to_local() if isinstance(g, DTensor) else g for g in grads]):
            torch._foreach_mul_(dtype_group, coef.to(dtype_group[0].dtype))
    return norm
