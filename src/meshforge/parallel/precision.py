"""Mixed precision: bf16 autocast over fp32 master weights; the loss stays in fp32. fp8 runs are bf16 runs
whose chosen linear layers compute in fp8 (parallel/fp8.py). Which of autocast and FSDP2's cast-once
policy a run uses is decided once, in the run plan (resolve.py)."""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision in ("bf16", "fp8"):  # fp8: bf16 around the fp8 linears (parallel/fp8.py)
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
