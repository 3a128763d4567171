"""bench/gpu/trace_summary.py: the GPU suite's one-step profile summary (kernel classes, busy %)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
from trace_summary import busy_time, classify, short, summarize  # noqa: E402


def test_classify_kernel_names() -> None:
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMM"
    assert classify("nvjet_tst_128x256_64x4") == "GEMM"
    assert classify("flash_fwd_kernel") == "attention"
    assert classify("multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert classify("ncclDevKernel_AllGather_RING") == "comm"
    assert classify("triton_red_fused_rms_norm_0") == "reduction"
    assert classify("vectorized_elementwise_kernel<copy>") == "elementwise"


def test_busy_time_merges_overlaps() -> None:
    assert busy_time([(0, 10), (5, 15), (20, 30)]) == 25
    assert busy_time([]) == 0


def test_summarize_trace(tmp_path: Path) -> None:
    ev = [
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 0, "dur": 60},
        {"ph": "X", "cat": "kernel", "name": "elementwise_add", "ts": 60, "dur": 20},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 90, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    s = summarize(p)
    assert s["busy_pct"] == 90.0 and s["span_ms"] == 0.1
    assert list(s["classes"]) == ["GEMM", "elementwise", "memcpy"] and round(s["classes"]["GEMM"], 2) == 66.67
    assert short(s) == "busy 90%: GEMM 67, elementwise 22, memcpy 11"  # shares of kernel time
    assert short(summarize(tmp_path / "t.json") | {"busy_pct": None}) == "-"
