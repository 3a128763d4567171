"""One profiled step, summarized the same way for meshforge and its peer: GPU busy % and the
share of GPU time per kernel class, read from a torch.profiler Chrome trace.

    python bench/gpu/trace_summary.py run/profile/rank-00000.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# first match wins; names are lower-cased kernel names from CUPTI
CLASSES = (
    ("memcpy", ("memcpy", "memset")),
    ("comm", ("nccl", "allgather", "reducescatter", "allreduce")),
    ("optimizer", ("multi_tensor", "adam", "foreach", "fused_adam")),
    ("attention", ("flash", "fmha", "attention", "flex", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("GEMM", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "_mm_", "mm_kernel", "wgmma", "scaled_mm")),
    ("reduction", ("reduce", "softmax", "norm", "sum_", "max_", "cross_entropy", "nll")),
)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def classify(name: str) -> str:
    """The kernel class of one kernel name (elementwise when nothing else matches)."""
    n = name.lower()
    for cls, keys in CLASSES:
        if any(k in n for k in keys):
            return cls
    return "elementwise"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(path: str | Path) -> dict:
    """GPU busy % over the traced span and each kernel class's share of the kernel time."""
    events = json.loads(Path(path).read_text()).get("traceEvents", [])
    gpu = [e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X" and "dur" in e]
    if not gpu:
        return {"busy_pct": None, "span_ms": 0.0, "classes": {}}
    iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    span = max(e for _, e in iv) - min(s for s, _ in iv)
    per: dict[str, float] = {}
    for e in gpu:
        c = "memcpy" if e["cat"] != "kernel" else classify(e.get("name", ""))
        per[c] = per.get(c, 0.0) + float(e["dur"])
    total = sum(per.values()) or 1.0
    shares = {k: 100 * v / total for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    return {"busy_pct": 100 * busy_time(iv) / span if span else None, "span_ms": span / 1e3, "classes": shares}


def short(s: dict | None, top: int = 3) -> str:
    """'busy 89%: GEMM 55, optimizer 11, reduction 6' for a table cell."""
    if not s or s.get("busy_pct") is None:
        return "-"
    parts = ", ".join(f"{k} {v:.0f}" for k, v in list(s["classes"].items())[:top])
    return f"busy {s['busy_pct']:.0f}%: {parts}"


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p, json.dumps(summarize(p)))
