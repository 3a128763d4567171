"""Mixed precision: bf16 autocast over fp32 master weights; the loss stays in fp32. fp8 runs are bf16 runs
whose chosen linear layers compute in fp8 (parallel/fp8.py)."""

from __future__ import annotations

import contextlib

import torch


def resolve_precision(requested: str, device: torch.device) -> str:
    """``auto`` is bf16 on CUDA (tensor cores) and fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if requested == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return requested


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision in ("bf16", "fp8"):  # fp8: bf16 around the fp8 linears (parallel/fp8.py)
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_mixed_precision(requested: str, device: torch.device) -> str:
    """``auto`` is cast_once on CUDA and autocast on CPU: on a CPU, FSDP2's per-unit host work and
    one-rank collectives cost more than the casts it saves (bench/bench_cast_once.py)."""
    if requested == "auto":
        return "cast_once" if device.type == "cuda" else "autocast"
    return requested
