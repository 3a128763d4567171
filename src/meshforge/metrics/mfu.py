"""Peak FLOP/s per device and precision, and MFU/HFU against it.

GPU peaks are the vendors' dense (no sparsity) tensor-core figures. "fp32" on a GPU
means TF32 tensor cores, which is what PyTorch matmuls use when TF32 is allowed. A CPU
has no datasheet number we can trust, so its peak is measured once by a short matmul
calibration and cached: MFU on a CPU is then "fraction of the best matmul throughput
this machine showed", a real and comparable number.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from meshforge.data.prepare import default_cache_dir

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


def _cache_file() -> Path:
    return default_cache_dir() / "cpu_peak.json"


def calibrate_cpu_peak(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5) -> float:
    """Best observed matmul FLOP/s on this CPU with the current thread count.

    Starts small and grows the matrices only while one matmul stays cheap, so a CPU
    that is slow in a dtype (bf16 without native support) is measured in well under a second.
    """
    n = 128
    while n < size:
        a = torch.randn(2 * n, 2 * n, dtype=dtype)
        t0 = time.perf_counter()
        a @ a
        if time.perf_counter() - t0 > seconds / 20:
            break
        n *= 2
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def cpu_peak_flops(precision: str) -> float:
    """Calibrated CPU peak for ``precision``, cached per CPU model, thread count and torch version."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    key = f"{platform.processor() or platform.machine()}|threads={torch.get_num_threads()}|{torch.__version__}|{dtype}"
    f = _cache_file()
    try:
        cache = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}
    if key not in cache:
        cache[key] = calibrate_cpu_peak(dtype)
        try:
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(f)
        except OSError:
            pass  # a read-only home only costs a recalibration next time
    return float(cache[key])


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
