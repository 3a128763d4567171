import json
import time

import pytest
import torch

from conftest import cached_cpu_peak
from meshforge.errors import ConfigError
from meshforge.metrics import cpu_peak, mfu
from meshforge.models import flops
from meshforge.models.flops import (
    hardware_flops_per_token,
    matmul_params,
    model_flops_per_token,
)
from meshforge.models.llama import ModelShape, build_model
from meshforge.models.presets import PRESETS
from meshforge.parallel.pipeline.split import _costs
from meshforge.planner.model_flags import check_flags, from_preset

A = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=100, max_seq_len=64)


def test_flops_against_hand_computation():
    # per layer: q,o 64x64 each; k,v 64x32 each; 3 FFN matrices 64x128; head 100x64
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert matmul_params(A) == 2 * per_layer + 6400 == 80128
    # 6N + 12 * layers * seq * (heads * head_dim), seq = 32
    assert model_flops_per_token(A, 32) == 6 * 80128 + 12 * 2 * 32 * 64 == 529920
    assert hardware_flops_per_token(A, 32, "none") == 529920
    # full: the blocks' forward again but w2 (64x128 per layer) and the head (100x64): what runs
    assert hardware_flops_per_token(A, 32, "full") == 529920 + 2 * (80128 - 2 * 64 * 128 - 6400) + 4 * 2 * 32 * 64
    assert hardware_flops_per_token(A, 32, "selective") == 529920 + 4 * 2 * 32 * 64


def _same_counts(shape, args, seq=4096):
    assert shape.num_params() == flops.num_params(args)
    assert shape.matmul_params() == flops.matmul_params(args)
    assert shape.block_params() == flops.block_params(args)
    assert shape.model_flops_per_token(seq) == flops.model_flops_per_token(args, seq)
    for rc in ("none", "selective", "full"):
        assert shape.hardware_flops_per_token(seq, rc) == flops.hardware_flops_per_token(args, seq, rc)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_planner_shape_and_flops_agree_on_every_preset(name):
    _same_counts(from_preset(name), PRESETS[name])
    assert from_preset(name).active_params() == flops.active_params(PRESETS[name])


def test_head_dim_other_than_hidden_over_heads_counts_everywhere():
    args = ModelShape(
        hidden=64,
        layers=3,
        heads=4,
        kv_heads=2,
        ffn_hidden=96,
        vocab_size=50,
        max_seq_len=32,
        head_dim=40,
        qk_norm=True,
    )
    counted = sum(p.numel() for p in build_model(args, device="meta").parameters())
    assert flops.num_params(args) == counted
    shape = ModelShape(
        layers=3, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=50, head_dim=40, qk_norm=True
    )
    assert shape.kv_dim == 80 and shape.vocab_size == 50
    _same_counts(shape, args, seq=32)
    # attention: 2 * seq * heads * head_dim per token, layer and matmul (not seq * hidden)
    assert flops.attention_flops_per_token(args, 32) == 4 * 3 * 32 * 160
    with pytest.raises(ConfigError, match="multiple of heads"):
        check_flags(ModelShape(layers=3, hidden=66, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=50))


def test_gpt_shape_counts_layernorm_biases_and_learned_positions():
    h, f, v, p, L = 768, 3072, 50257, 1024, 12
    gpt2 = ModelShape(
        layers=L,
        hidden=h,
        heads=12,
        kv_heads=12,
        ffn_hidden=f,
        vocab_size=v,
        mlp="gelu",
        tie_embeddings=True,
        max_positions=p,
        name="gpt2",
    )
    per_block = 4 * h * h + 2 * h * f + 4 * h  # q,k,v,o; fc, proj; two LayerNorms with biases
    assert gpt2.block_params() == flops.block_params(gpt2) == per_block
    assert gpt2.num_params() == flops.num_params(gpt2) == L * per_block + (v + p) * h + h
    assert gpt2.matmul_params() == L * (4 * h * h + 2 * h * f) + v * h
    assert gpt2.model_flops_per_token(1024) == 6 * gpt2.matmul_params() + 12 * L * 1024 * h


def test_pipeline_block_cost_is_the_flop_count():
    args = PRESETS["debug"]
    block, emb, head = _costs(args, 256)
    assert block == flops.block_flops_per_token(args, 256) == 6 * flops.block_matmul_params(args) + 12 * 256 * 128
    assert head == 6 * 512 * 128 and emb == head / 3
    total = args.layers * block + head
    assert total == flops.model_flops_per_token(args, 256)


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
    monkeypatch.setattr(cpu_peak, "calibrate_cpu_peak", lambda dtype: calls.append(dtype) or 5e10)
    assert mfu.peak_flops(torch.device("cpu"), "fp32") == 5e10
    assert mfu.peak_flops(torch.device("cpu"), "fp32") == 5e10
    assert len(calls) == 1 and (tmp_path / "cpu_peak.json").is_file()


@pytest.mark.parametrize(
    "entry, measured",
    [({}, False), ({"measured_at": 0.0}, True), ({"machine": "another"}, True)],
    ids=["fresh", "too-old", "other-machine"],
)
def test_a_cached_peak_has_an_age_and_a_machine(monkeypatch, tmp_path, entry, measured):
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_peak, "calibrate_cpu_peak", lambda dtype: 7e10)
    cached_cpu_peak(tmp_path, **entry)
    assert cpu_peak.cpu_peak_flops("fp32") == (7e10 if measured else 1e6)
    stored = json.loads((tmp_path / "cpu_peak.json").read_text())["entries"][cpu_peak._key(torch.float32)]
    assert stored["machine"] == cpu_peak.machine_fingerprint() and time.time() - stored["measured_at"] < 60


def test_a_peak_the_run_beats_is_measured_again_or_estimated(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_peak, "calibrate_cpu_peak", lambda dtype: 5e10)
    assert cpu_peak.recheck("fp32", 2e10) == (5e10, "measured again")
    peak, how = cpu_peak.recheck("fp32", 9e12)  # more than any measurement: the estimate (at least what it reached)
    assert how == "estimate" and peak >= 9e12
    assert cpu_peak.flops_per_cycle("fma avx avx2", "x86_64", False) == 32
    assert cpu_peak.flops_per_cycle("avx512f avx512_bf16", "x86_64", True) == 128


def test_real_cpu_calibration_is_plausible():
    flops = cpu_peak.calibrate_cpu_peak(torch.float32, size=256, seconds=0.1)
    assert 1e8 < flops < 1e14
