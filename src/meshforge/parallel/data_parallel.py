"""Data parallelism. Stage 0 (replicated parameters, bucketed all-reduce overlapping backward)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshforge.parallel.mesh import Mesh


def apply_ddp(model: nn.Module, mesh: Mesh, bucket_cap_mb: int = 25) -> nn.Module:
    """Wrap in DDP over the data-parallel group; gradients arrive averaged over ranks."""
    assert mesh.device_mesh is not None
    return DistributedDataParallel(
        model,
        process_group=mesh.device_mesh.get_group("dp"),
        device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
    )
