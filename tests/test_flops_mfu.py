import pytest
import torch

from meshforge.metrics import mfu
from meshforge.models.flops import (
    hardware_flops_per_token,
    matmul_params,
    model_flops_per_token,
)
from meshforge.models.llama import ModelArgs

A = ModelArgs(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=100, max_seq_len=64)


def test_flops_against_hand_computation():
    # per layer: q,o 64x64 each; k,v 64x32 each; 3 FFN matrices 64x128; head 100x64
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert matmul_params(A) == 2 * per_layer + 6400 == 80128
    # 6N + 12 * layers * seq * (heads * head_dim), seq = 32
    assert model_flops_per_token(A, 32) == 6 * 80128 + 12 * 2 * 32 * 64 == 529920
    assert hardware_flops_per_token(A, 32, "none") == 529920
    assert hardware_flops_per_token(A, 32, "full") == 529920 + 2 * 80128 + 4 * 2 * 32 * 64
    assert hardware_flops_per_token(A, 32, "selective") == 529920 + 4 * 2 * 32 * 64


def test_mfu_arithmetic():
    # 529920 FLOPs/token at 10k tokens/s on a 1e10 FLOP/s device = 52.99%
    assert mfu.utilization(529920, 10_000, 1e10) == pytest.approx(0.529920)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA B200", "b200"),
        ("AMD Instinct MI300X", "mi300x"),
        ("Tesla T4", None),
    ],
)
def test_gpu_names_map_to_peaks(name, kind):
    assert mfu.gpu_kind(name) == kind


def test_peak_table_values():
    assert mfu.PEAK_TFLOPS["h100-sxm"]["bf16"] == pytest.approx(989.4)
    assert mfu.PEAK_TFLOPS["h100-sxm"]["fp8"] == pytest.approx(2 * 989.4, rel=1e-3)
    for table in mfu.PEAK_TFLOPS.values():
        assert table["bf16"] == pytest.approx(2 * table["fp32"], rel=0.05)


def test_cpu_peak_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(mfu, "calibrate_cpu_peak", lambda dtype: calls.append(dtype) or 5e10)
    assert mfu.peak_flops(torch.device("cpu"), "fp32") == 5e10
    assert mfu.peak_flops(torch.device("cpu"), "fp32") == 5e10
    assert len(calls) == 1 and (tmp_path / "cpu_peak.json").is_file()


def test_real_cpu_calibration_is_plausible():
    flops = mfu.calibrate_cpu_peak(torch.float32, size=256, seconds=0.1)
    assert 1e8 < flops < 1e14
