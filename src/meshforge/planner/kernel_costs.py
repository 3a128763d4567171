"""What one GPU's kernels cost beyond the ideal FLOP count: the achievable GEMM rate by GEMM
size, the attention core by sequence length and kernel (fused or scores written out), and
the memory-bound element-wise work of each block type (norms, residual adds, bias, GeLU or
SwiGLU, dropout, RoPE). Per GPU generation the figures are the presets' (hardware.py), the
block arithmetic is here; nothing is fitted to a particular run."""

from __future__ import annotations

import math

from meshforge.models import flops
from meshforge.models.shape import ModelShape
from meshforge.planner.hardware import Hardware


def gemm_rate(hw: Hardware, flop: float, precision: str) -> float:
    """FLOP/s of one GEMM of ``flop`` (2mnk): the generation's best share of peak, less for small ones."""
    return hw.peak(precision) * hw.gemm_efficiency * flop / (flop + hw.gemm_half_flop)


def gemm_rate_dims(hw: Hardware, m: float, n: float, k: float, precision: str) -> float:
    """FLOP/s of one (m, k) x (k, n) GEMM: by its smallest dimension where the preset prices
    GEMMs so (``hw.gemm_half_dim``, see dense_gemm_rate), else by its size 2mnk (gemm_rate)."""
    if not hw.gemm_half_dim:
        return gemm_rate(hw, 2 * m * n * k, precision)
    d = min(m, n, k)
    return hw.peak(precision) * hw.gemm_efficiency * d / (d + hw.gemm_half_dim)


def dense_gemm_rate(shape: ModelShape, hw: Hardware, tokens: float, tp: int, precision: str) -> float:
    """FLOP/s of a step's dense GEMMs (each block matrix and the head over ``tokens`` rows, on one
    tp rank), weighted by their FLOPs. With ``hw.gemm_half_dim`` each GEMM runs at the best share
    times d/(d + half_dim) for its smallest dimension d (a tile's prologue, epilogue and the last
    wave are paid per output tile, the K loop amortises them: a skinny GEMM, k/v projections of
    grouped-query attention, is slower); else all at the rate of one typical GEMM's size."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_hidden
    if not hw.gemm_half_dim:
        return gemm_rate(hw, 2 * tokens * h * max(f, h) / tp, precision)
    mats = [(h, h / tp), (h, kv / tp), (h, kv / tp), (h / tp, h), (h, f / tp), (f / tp, h)]
    mats = mats if shape.mlp == "swiglu" else mats[:2] + mats[3:]  # GeLU: no gate (k/v as one)
    weights = [a * b * shape.layers for a, b in mats] + [h * shape.vocab_size / tp]
    dims = [min(tokens, a, b) for a, b in mats] + [min(tokens, h)]
    best = hw.peak(precision) * hw.gemm_efficiency
    return sum(weights) / sum(w * (d + hw.gemm_half_dim) / (best * d) for w, d in zip(weights, dims, strict=True))


def flash_attention_rate(hw: Hardware, seq: int, precision: str) -> float:
    """FLOP/s of a fused (FlashAttention-style) attention core, forward and backward; a GPU
    kernel reaches half of its best rate at ``hw.attention_half_seq`` (short sequences give
    each thread block too little work along the keys)."""
    return hw.peak(precision) * hw.attention_efficiency * seq / (seq + hw.attention_half_seq)


def kernel_shares(hw: Hardware, head_dim: int) -> tuple[float, float]:
    """(forward, backward) share of peak of the preset's fused attention kernel at ``head_dim``
    (log-linear between the published head dims, the nearest one beyond them): a smaller head
    dim does fewer matmul FLOPs per softmax element (exp throughput, not the tensor cores, bounds it)."""
    dims = sorted((int(d), v) for d, v in hw.attention_kernel.items())
    if head_dim <= dims[0][0]:
        return tuple(dims[0][1])
    for (d0, v0), (d1, v1) in zip(dims, dims[1:], strict=False):
        if head_dim <= d1:
            w = math.log(head_dim / d0) / math.log(d1 / d0)
            return v0[0] + w * (v1[0] - v0[0]), v0[1] + w * (v1[1] - v0[1])
    return tuple(dims[-1][1])


def kernel_attention_seconds(
    shape: ModelShape, hw: Hardware, seq: int, tokens: float, layers: float, recompute: str, precision: str
) -> float:
    """A fused causal kernel's own work at its published rates: the forward computes half the
    score square (2·s·heads·head_dim FLOPs per token and layer: the MFU convention counts the
    whole square, 4·s·...), the backward 2.5x the forward's FLOPs (FlashAttention's five
    matmuls to the forward's two) at its own rate, recomputation one more forward."""
    fwd, bwd = kernel_shares(hw, shape.head_dim)
    rate = hw.peak(precision) * seq / (seq + hw.attention_half_seq)
    flop = 0.5 * flops.attention_flops_per_token(shape, seq) / shape.layers * tokens * layers
    forwards = 2 if recompute in ("full", "selective") else 1
    return flop * forwards / (rate * fwd) + 2.5 * flop / (rate * bwd)


def scores_bytes_per_element(recompute: str) -> float:
    """Bytes moved per attention-score element (heads x s x s) when the scores are written
    out (Megatron-LM's fused scale-mask-softmax, then dropout): forward writes the scores (2),
    softmax reads and writes them (4), dropout reads them and writes output and mask (5), the
    weighted sum reads them (2); backward about 17; recomputation repeats the forward."""
    forward, backward = 13.0, 17.0
    return forward + backward + (forward if recompute in ("full", "selective") else 0.0)


def elementwise_elements(shape: ModelShape) -> tuple[float, float]:
    """Elements read and written per token and layer by one forward's memory-bound kernels
    (backward moves about twice as many), as (residual-stream part, tp-sharded part). GPT
    block: two LayerNorms (2h each), bias + dropout + residual twice (3.5h each, the mask at
    one byte), bias + GeLU over the 4h MLP (2·ffn). Llama block: two RMSNorms (2h each), two
    residual adds (3h each), RoPE on q and k (2·(h + kv)), SwiGLU (3·ffn)."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_hidden
    if shape.mlp == "gelu":
        dropout = 0.5 if shape.attention == "materialized" else 0.0  # Megatron's GPT trains with dropout
        return 4 * h + 2 * (3 + dropout) * h, 2.0 * f
    return 10.0 * h, 2.0 * (h + kv) + 3 * f


def eager_extra_bytes(shape: ModelShape) -> float:
    """Bytes per token and layer one forward of meshforge's Llama block moves run op by op
    (``train.compile = false``) beyond the fused count of ``elementwise_elements``, from
    models/llama.py's ops at bf16 (2 bytes) and fp32 (4): an RMSNorm is x.float() (2 read +
    4 written), rms_norm (4 + 4), times weight.float() (4 + 4), .to(bf16) (4 + 2) = 28·h
    bytes against a fused 4·h, twice per block; RoPE on q and k is float casts, rotate-half
    (neg, cat), two products, a sum and a cast back: about 50 bytes per element against 4;
    SwiGLU's silu and product are two kernels, 10·ffn bytes against 6. A GPT block (fused
    LayerNorm, bias-GeLU in the runs this models) has none."""
    if shape.mlp != "swiglu":
        return 0.0
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_hidden
    return 2 * (28 - 4) * h + (50 - 4) * (h + kv) + (10 - 6) * f


def loss_seconds(shape: ModelShape, hw: Hardware, tokens: float, tp: int, eager: bool) -> float:
    """The cross-entropy over the head's logits (models/loss.py: logits.float() then
    F.cross_entropy), memory-bound, per vocab entry and token: eager, the cast (2 read + 4
    written), log-softmax (4 + 4) and in backward its gradient (8 + 4) and the cast's (4 + 2):
    32 bytes; compiled, the bf16 logits read, the gradient written and read back: 8."""
    per_vocab = 32.0 if eager else 8.0
    return per_vocab * shape.vocab_size / tp * tokens / hw.hbm_bw


def elementwise_seconds(
    shape: ModelShape, hw: Hardware, tokens: float, layers: float, recompute: str, bytes_per: int, replicated: int = 1
) -> float:
    """Memory-bound work of ``layers`` blocks over ``tokens`` tokens (this GPU's share):
    forward, backward (2x) and the recomputed forward; the residual-stream part runs
    ``replicated`` times over (tp without sequence parallelism repeats it on every tp rank).
    A calibrated profile's measured per-pass figure (a real block's work outside GEMMs and
    attention, in units of hidden) replaces the block formula."""
    passes = 3 if recompute == "none" else 4
    if hw.elementwise_bytes_per_hidden:
        per_pass = hw.elementwise_bytes_per_hidden * shape.hidden
    else:
        stream, sharded = elementwise_elements(shape)
        per_pass = stream * replicated + sharded
        per_pass += eager_extra_bytes(shape) / 2 if hw.eager else 0.0  # in bf16 elements' units
    return per_pass * bytes_per * passes * layers * tokens / hw.hbm_bw


def attention_seconds(
    shape: ModelShape, hw: Hardware, seq: int, tokens: float, layers: float, recompute: str, precision: str, gemm: float
) -> float:
    """The attention core (scores and weighted sum) of ``layers`` blocks over ``tokens``
    tokens, forward + backward (+ the recomputed forward): a fused kernel at its rate for this
    sequence length; written-out scores as batched GEMMs at ``gemm`` FLOP/s plus their memory
    traffic."""
    if shape.attention == "flash" and hw.attention_kernel:
        return kernel_attention_seconds(shape, hw, seq, tokens, layers, recompute, precision)
    per_token = 3.0 * flops.attention_flops_per_token(shape, seq) / shape.layers
    if recompute in ("full", "selective"):
        per_token *= 4 / 3
    flop = per_token * tokens * layers
    if shape.attention == "flash":
        return flop / flash_attention_rate(hw, seq, precision)
    scores = shape.heads * seq * tokens * layers  # heads x s x s per sequence of s tokens
    bytes_per = scores_bytes_per_element(recompute) * (2 if precision == "fp32" else 1)
    return flop / gemm + scores * bytes_per / hw.hbm_bw
