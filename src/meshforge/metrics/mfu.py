"""Peak FLOP/s per device and precision, and MFU/HFU against it.

GPU peaks are the vendors' dense (no sparsity) tensor-core figures. "fp32" on a GPU
means TF32 tensor cores, which is what PyTorch matmuls use when TF32 is allowed. A CPU
has no datasheet number we can trust, so its peak is measured by a short matmul
calibration and cached (metrics/cpu_peak.py: with its age and machine, and checked against
what a run reaches): MFU on a CPU is then "fraction of the best matmul throughput this
machine showed", a real and comparable number.
"""

from __future__ import annotations

import time

import torch

from meshforge.metrics.cpu_peak import cpu_peak_flops

TFLOPS = 1e12

# Dense peak TFLOP/s by device and precision.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "a100": {"fp32": 156.0, "bf16": 312.0},
    "h100-sxm": {"fp32": 494.7, "bf16": 989.4, "fp8": 1978.9},
    "h100-pcie": {"fp32": 378.0, "bf16": 756.0, "fp8": 1513.0},
    "h200": {"fp32": 494.7, "bf16": 989.4, "fp8": 1978.9},
    "b200": {"fp32": 1100.0, "bf16": 2250.0, "fp8": 4500.0},
    "mi300x": {"fp32": 653.7, "bf16": 1307.4, "fp8": 2614.9},
}


def gpu_kind(name: str) -> str | None:
    """Map a CUDA device name to a key of PEAK_TFLOPS."""
    n = name.lower()
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-sxm"
    if "a100" in n:
        return "a100"
    if "b200" in n:
        return "b200"
    if "mi300x" in n or "mi300" in n:
        return "mi300x"
    return None


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s of one device at ``precision`` (fp32 | bf16 | fp8)."""
    if device.type == "cuda":
        kind = gpu_kind(torch.cuda.get_device_name(device))
        if kind is not None:
            table = PEAK_TFLOPS[kind]
            return table.get(precision, table["bf16"]) * TFLOPS
        # Unknown GPU: fall back to a measured figure rather than a wrong constant.
        return _calibrate_cuda(device, precision)
    return cpu_peak_flops(precision)


def _calibrate_cuda(device: torch.device, precision: str) -> float:
    dtype = torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32
    a = torch.randn(4096, 4096, device=device, dtype=dtype)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize(device)
    return 10 * 2 * 4096**3 / (time.perf_counter() - t0)


def utilization(flops_per_token: float, tokens_per_s_per_device: float, peak: float) -> float:
    """MFU (with model FLOPs) or HFU (with hardware FLOPs) as a fraction of peak."""
    return flops_per_token * tokens_per_s_per_device / peak if peak > 0 else 0.0
