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
    b200 = get_hardware("b200")  # no published kernel table: one fused share, halved at 1K tokens
    short = kernel_costs.flash_attention_rate(b200, 512, "bf16")
    long = kernel_costs.flash_attention_rate(b200, 16384, "bf16")
    assert short < 0.5 * long < long <= b200.peak("bf16") * b200.attention_efficiency
    # a preset with a published kernel: seconds per token and key grow as the sequence shrinks
    per_key = [kernel_costs.attention_seconds(GPT, H100, s, 1e6, 24, "none", "bf16", 1.0) / s for s in (512, 16384)]
    assert per_key[0] > 1.3 * per_key[1]


def test_kernel_attention_is_the_causal_half_with_a_backward_of_two_and_a_half_forwards():
    """The kernel does half the score square (the MFU count takes all of it) and its backward
    five matmuls to the forward's two, each at its published rate; recomputation adds a forward."""
    seq, tokens = 4096, 1e6
    fwd, bwd = kernel_costs.kernel_shares(H100, 128)
    assert (fwd, bwd) == (H100.attention_kernel["128"][0], H100.attention_kernel["128"][1])
    rate = H100.peak("bf16") * seq / (seq + H100.attention_half_seq)
    half = 2.0 * seq * GPT.heads * GPT.head_dim * tokens * GPT.layers  # GPT: head_dim 96, between 64 and 128
    f, b = kernel_costs.kernel_shares(H100, GPT.head_dim)
    assert H100.attention_kernel["64"][0] < f < fwd
    got = kernel_costs.attention_seconds(GPT, H100, seq, tokens, GPT.layers, "none", "bf16", 1.0)
    assert got == pytest.approx(half / (rate * f) + 2.5 * half / (rate * b))
    again = kernel_costs.attention_seconds(GPT, H100, seq, tokens, GPT.layers, "full", "bf16", 1.0)
    assert again - got == pytest.approx(half / (rate * f))


def test_hopper_gemms_are_faster_the_larger_their_smallest_dimension():
    """Hopper's GEMMs by their smallest dimension: a 3B block (hidden 3072) runs its GEMMs faster
    than a 1B block (2048) on the same tokens, and more tokens per micro-batch help until the
    weights' dimensions bound them."""
    from meshforge.models.presets import PRESETS as MODELS

    one, three = MODELS["llama3.2-1b"], MODELS["llama3.2-3b"]
    r1 = kernel_costs.dense_gemm_rate(one, H100, 8192, 1, "bf16")
    r3 = kernel_costs.dense_gemm_rate(three, H100, 8192, 1, "bf16")
    assert r1 < r3 < H100.peak("bf16") * H100.gemm_efficiency
    assert kernel_costs.dense_gemm_rate(one, H100, 512, 1, "bf16") < r1


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


def test_ampere_gemms_by_their_smallest_dimension_at_hoppers_half_rate_scaled_by_machine_balance():
    """Issue 51: the roofline gives a GEMM whose smallest dimension is d the rate best·d/(d + c·balance),
    balance = bf16 peak / HBM bandwidth; c is Hopper's (fitted on meshforge's H100 runs), so an A100
    halves at ~210, not at a size in FLOPs that no transformer GEMM comes near. Megatron's pipelined
    micro-batches of 2,048 tokens run slower GEMMs than its 32K-token ones; skinny tp shards too."""
    balance = {hw.name: hw.peak("bf16") / hw.hbm_bw for hw in (A100, H100)}
    assert H100.gemm_half_dim == 400.0
    assert A100.gemm_half_dim == pytest.approx(400.0 * balance["a100-80g"] / balance["h100-sxm"])
    assert 200 < A100.gemm_half_dim < 215
    best = A100.peak("bf16") * A100.gemm_efficiency
    assert kernel_costs.gemm_rate_dims(A100, 2048, 9600, 25600, "bf16") == pytest.approx(best * 2048 / 2256, rel=0.01)
    assert kernel_costs.gemm_rate_dims(A100, 32768, 6144, 768, "bf16") < 0.8 * best
    pipelined, flat = (kernel_costs.dense_gemm_rate(GPT, A100, t, 1, "bf16") for t in (2048, 32768))
    assert pipelined < flat < best


def test_ampere_attention_runs_flashattention2s_published_rates():
    """Issue 51: an A100 prices its fused attention at FlashAttention-2's A100 rates (73% / 63% of
    peak forward / backward on the kernel's FLOPs), the 2022 Triton kernel (llm-foundry's) at 1/1.4
    and 1/2 of them, as FlashAttention-2's paper measured the two on the A100; not one fitted share."""
    from meshforge.planner.hardware import ATTENTION_KERNELS

    assert A100.attention_kernel == ATTENTION_KERNELS["fa2-a100"] == {"128": [0.73, 0.63]}
    triton = replace(A100, attention_kernel=ATTENTION_KERNELS["triton-a100"])
    assert kernel_costs.kernel_shares(triton, 128) == pytest.approx((0.73 / 1.4, 0.63 / 2))
    fa2, old = (kernel_costs.attention_seconds(GPT, hw, 2048, 1e6, 24, "none", "bf16", 1.0) for hw in (A100, triton))
    assert 1.4 < old / fa2 < 2.0
