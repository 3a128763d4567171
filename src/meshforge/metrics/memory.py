"""Bytes a rank holds for training state, counted from the tensors themselves.

Sharded tensors (DTensor) count their local shard only, so the numbers can be checked
against the ZeRO formulas directly (see parallel/data/apply.py).
"""

from __future__ import annotations

import resource

import torch
from torch import nn
from torch.distributed.tensor import DTensor

GIB = 2**30


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _unique(tensors):
    seen = set()
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            yield t


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds now."""
    params = list(_unique(model.parameters()))
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's state inside
    opt = sum(_local_bytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    opt += sum(_local_bytes(t) for t in getattr(optimizer, "master_shards", ()))  # bf16 ZeRO-1's fp32 shard
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params),
        "optimizer": opt,
    }


def host_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The part of ``state_bytes`` held in host memory (CPU offload on a GPU run)."""
    params = [p for p in _unique(model.parameters()) if _on_host(p)]
    inner = getattr(optimizer, "optim", optimizer)
    tensors = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in _unique(model.parameters()) if _on_host(p.grad)),
        "optimizer": sum(_local_bytes(t) for t in tensors if _on_host(t)),
    }


def _on_host(t: torch.Tensor | None) -> bool:
    if t is None:
        return False
    return (t.to_local() if isinstance(t, DTensor) else t).device.type == "cpu"


def gathered_param_bytes(model: nn.Module) -> int:
    """Bytes of full (unsharded) parameters a sharded model holds right now, e.g. between
    forward and backward under ZeRO-2. Only meaningful for a model whose parameters are
    sharded at rest (FSDP2): there, any parameter that is not a DTensor is gathered."""
    return sum(p.numel() * p.element_size() for p in _unique(model.parameters()) if not isinstance(p, DTensor))


def peak_mem_gib(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA's max allocated, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
