"""The time model's kernel physics (planner/kernel_costs.py): each effect moves the estimate
the way the hardware does — written-out attention scores cost memory traffic that grows with
the sequence, a fused kernel is slower on short sequences, tp without sequence parallelism
repeats the residual-stream work, and an A100 reaches a larger share of its peak than an H100."""

from dataclasses import replace

import pytest

from meshforge.models.shape import ModelShape
from meshforge.planner import kernel_costs
from meshforge.planner.estimate import estimate, plan_layout
from meshforge.planner.hardware import get_hardware

A100, H100 = get_hardware("a100-80g"), get_hardware("h100-sxm")
GPT = ModelShape(
    layers=24,
    hidden=2304,
    heads=24,
    kv_heads=24,
    ffn_hidden=4 * 2304,
    vocab_size=51200,
    mlp="gelu",
    tie_embeddings=True,
    name="gpt-1.7b",
)


def test_materialized_scores_cost_traffic_that_grows_with_the_sequence():
    mat = replace(GPT, attention="materialized")
    rate = kernel_costs.gemm_rate(A100, 1e12, "bf16")
    for seq in (1024, 4096):
        flash = kernel_costs.attention_seconds(GPT, A100, seq, 1e6, 24, "none", "bf16", rate)
        written = kernel_costs.attention_seconds(mat, A100, seq, 1e6, 24, "none", "bf16", rate)
        assert written > flash
    # the scores' traffic: heads x s per token, 30 bytes per score without recomputation
    t1 = kernel_costs.attention_seconds(mat, A100, 2048, 1e6, 1, "none", "bf16", float("inf"))
    assert t1 == pytest.approx(GPT.heads * 2048 * 1e6 * 30 / A100.hbm_bw)
    assert kernel_costs.scores_bytes_per_element("full") == 43


def test_fused_attention_is_slower_per_flop_on_short_sequences():
    short = kernel_costs.flash_attention_rate(H100, 512, "bf16")
    long = kernel_costs.flash_attention_rate(H100, 16384, "bf16")
    assert short < 0.5 * long < long <= H100.peak("bf16") * H100.attention_efficiency


def test_tp_without_sequence_parallelism_repeats_the_residual_stream_work():
    lay = plan_layout(tp=8, pp=1, dp=1, micro_batch_size=1, num_microbatches=8, activation_checkpoint="full")
    loss = kernel_costs.loss_seconds(GPT, A100, 8 * 2048 / 8, 8, False)  # the head's logits, the same either way
    sp = estimate(GPT, lay, 2048, 8, "bf16", A100, 8).time["non_gemm"] - loss
    no_sp = estimate(GPT, replace(lay, sequence_parallel=False), 2048, 8, "bf16", A100, 8).time["non_gemm"] - loss
    stream, sharded = kernel_costs.elementwise_elements(GPT)
    assert no_sp / sp == pytest.approx((8 * stream + sharded) / (stream + sharded))


def test_gemm_share_of_peak_by_generation():
    big = 1e13
    a100 = kernel_costs.gemm_rate(A100, big, "bf16") / A100.peak("bf16")
    h100 = kernel_costs.gemm_rate(H100, big, "bf16") / H100.peak("bf16")
    assert a100 > h100 > 0.5
    assert kernel_costs.gemm_rate(H100, 1e9, "bf16") < 0.5 * kernel_costs.gemm_rate(H100, big, "bf16")
