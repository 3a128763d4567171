"""Parameters and FLOPs per token: the numerator of MFU and HFU, and the one count the
planner and the pipeline's stage balancing use too.

Every function takes a duck-typed shape: anything with ``hidden``, ``layers``, ``heads``,
``kv_heads``, ``head_dim``, ``ffn_hidden``, ``vocab_size``, ``tie_embeddings``, and
optionally ``mlp`` ("swiglu" | "gelu"; default swiglu), ``max_positions`` (learned
position embeddings, GPT-style; default 0) and ``qk_norm`` (default False). A
``ModelShape`` and the planner's ``Shape`` both are one.

Parameters: a block has wq, wo (hidden x heads*head_dim), wk, wv (hidden x
kv_heads*head_dim), the MLP (SwiGLU: three hidden x ffn matrices; GeLU: two), two norms
of size hidden (LayerNorm, with the GeLU MLP, also has a bias of that size) and, with
QK-norm, two of size head_dim. Linear layers have no biases. Outside the blocks: the
token (and learned position) embedding, the final norm (hidden) and the head (vocab x
hidden; none when tied to the embedding).

Mixtures of experts (``num_experts`` > 0, on the blocks ``models/moe.is_moe_layer``
picks): an MoE block holds the router (E x hidden), E experts and the shared experts
(three hidden x moe_ffn matrices each) in place of the MLP; all of them count as
parameters, but a token runs through only its k chosen experts and the shared ones, so
model FLOPs (and MFU) count those *active* parameters; the router and the dispatch are
not model FLOPs. Functions taking ``layer_id`` describe that block; without it, the
mean block (so layers x block = the model's blocks).

FLOPs (the convention PaLM, Megatron-LM and torchtitan use, so MFU compares with
published numbers): a matmul of an (m, k) by (k, n) matrix costs 2mkn; the backward
pass costs twice the forward. Per token and layer, attention scores (QK^T) and the
weighted sum (AV) each cost 2 * seq * (heads * head_dim) in the forward pass, counted
over the FULL seq x seq square even though causal masking makes half of it zeros —
kernels like FlashAttention skip that half, so on them the real work is lower than
this count and MFU is slightly optimistic. Under document masks (packed documents) the
same count runs over each document's own square: ``seq`` becomes the span sum(L²) / seq
(``Documents.span``, ``document_span``), the FLOPs as executed (docs/metrics.md).
Embedding lookups are not matmuls and are not counted; the output head is (also when
tied to the embedding). Norms, RoPE and activations are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from meshforge.models.moe import expert_ffn, is_moe_layer

ShapeLike = Any  # duck-typed: see the module docstring


def _gelu(a: ShapeLike) -> bool:
    return getattr(a, "mlp", "swiglu") == "gelu"


def _attention_params(a: ShapeLike) -> int:
    return 2 * a.hidden * a.heads * a.head_dim + 2 * a.hidden * a.kv_heads * a.head_dim


def _moe_ids(a: ShapeLike) -> list[int]:
    return [i for i in range(a.layers) if is_moe_layer(a, i)]


def _per_block(a: ShapeLike, layer_id: int | None, dense: int, moe: int) -> int:
    """A block's count (``layer_id``), or the mean block's (rounded down)."""
    if layer_id is not None:
        return moe if is_moe_layer(a, layer_id) else dense
    n = len(_moe_ids(a))
    return ((a.layers - n) * dense + n * moe) // a.layers


def moe_expert_params(a: ShapeLike) -> int:
    """The routed experts of one MoE block (what expert parallelism splits)."""
    return a.num_experts * 3 * a.hidden * expert_ffn(a)


def _moe_block_matmul(a: ShapeLike, active: bool) -> int:
    shared = a.num_shared_experts * 3 * a.hidden * expert_ffn(a)
    if active:  # the k chosen experts; the router is not a model FLOP
        return _attention_params(a) + a.experts_per_token * 3 * a.hidden * expert_ffn(a) + shared
    return _attention_params(a) + moe_expert_params(a) + shared + a.num_experts * a.hidden


def block_matmul_params(a: ShapeLike, layer_id: int | None = None, active: bool = True) -> int:
    """Weights of one block's matmuls (attention projections and MLP, or an MoE block's
    active experts; ``active=False``: all its experts and the router)."""
    dense = _attention_params(a) + (2 if _gelu(a) else 3) * a.hidden * a.ffn_hidden
    if getattr(a, "num_experts", 0) <= 0:
        return dense
    return _per_block(a, layer_id, dense, _moe_block_matmul(a, active))


def block_params(a: ShapeLike, layer_id: int | None = None) -> int:
    """All parameters of one block: matmul weights (all experts) plus norms (and LayerNorm biases)."""
    norms = 2 * a.hidden * (2 if _gelu(a) else 1)
    qk = 2 * a.head_dim if getattr(a, "qk_norm", False) else 0
    return block_matmul_params(a, layer_id, active=False) + norms + qk


def embedding_params(a: ShapeLike) -> int:
    """Token embedding plus learned position embeddings (GPT-style; none with RoPE)."""
    return (a.vocab_size + getattr(a, "max_positions", 0)) * a.hidden


def head_params(a: ShapeLike) -> int:
    """The output head's own weights: none when tied to the embedding."""
    return 0 if a.tie_embeddings else a.vocab_size * a.hidden


def _over_blocks(a: ShapeLike, per_block: Callable[[ShapeLike, int], int]) -> int:
    """``per_block(a, i)`` summed over the blocks. A dense model's blocks are all alike: one
    call times the layers, the same integer (the planner's search asks this ~10^5 times per
    model, and a 126-layer loop per call made a 405B search take a minute)."""
    if getattr(a, "num_experts", 0) <= 0:
        return a.layers * per_block(a, 0)
    return sum(per_block(a, i) for i in range(a.layers))


def matmul_params(a: ShapeLike) -> int:
    """Parameters that take part in a matmul per token (all linear weights, incl. the head;
    of an MoE block only the active experts)."""
    return _over_blocks(a, block_matmul_params) + a.vocab_size * a.hidden


def num_params(a: ShapeLike) -> int:
    """All parameters, counting a tied embedding/head once."""
    return _over_blocks(a, block_params) + embedding_params(a) + head_params(a) + a.hidden


def active_params(a: ShapeLike) -> int:
    """Parameters a token uses: all of a dense model, an MoE block's chosen and shared experts only."""
    inactive = _over_blocks(a, lambda s, i: block_matmul_params(s, i, False) - block_matmul_params(s, i))
    return num_params(a) - inactive


def attention_flops_per_token(a: ShapeLike, seq_len: float) -> float:
    """Forward-pass FLOPs of scores and weighted sum, per token, all layers (``seq_len``: the keys
    a query attends to in the full-square count; under document masks a ``Documents.span``)."""
    return 4.0 * a.layers * seq_len * a.heads * a.head_dim


def document_span(seq_len: int, mean_doc_len: float) -> float:
    """The expected keys per query under document masks, counted like ``seq_len`` is here (the
    full square of each document): E[sum of L²] / S over the documents L of a sequence of S
    tokens, for document lengths exponentially distributed with mean N (boundaries a Poisson
    process): 2N - 2N²(1 - exp(-S/N)) / S. It tends to S for long documents; 0 means none."""
    if mean_doc_len <= 0:
        return float(seq_len)
    n, s = float(mean_doc_len), float(seq_len)
    return 2 * n - 2 * n * n * -math.expm1(-s / n) / s


def model_flops_per_token(a: ShapeLike, seq_len: float) -> float:
    """Forward + backward model FLOPs per token: 6N + 12 * layers * seq * heads * head_dim."""
    return 6.0 * matmul_params(a) + 3.0 * attention_flops_per_token(a, seq_len)


def block_flops_per_token(a: ShapeLike, seq_len: int, layer_id: int | None = None) -> float:
    """Forward + backward model FLOPs of one block per token (its matmuls and attention core)."""
    return 6.0 * block_matmul_params(a, layer_id) + 12.0 * seq_len * a.heads * a.head_dim


def head_flops_per_token(a: ShapeLike) -> float:
    """Forward + backward FLOPs of the output head per token."""
    return 6.0 * a.vocab_size * a.hidden


def recomputed_matmul_params(a: ShapeLike) -> int:
    """Matmul weights whose forward GEMM full activation checkpointing runs again in backward:
    every block's but its last GEMM's (a dense block's MLP-out, w2 / fc2: its output is only
    added to the residual, backward never reads it, and torch's checkpoint stops recomputing once
    backward has the tensors it reads), never the head's (checkpointing wraps the blocks). An
    MoE block's routed experts run again whole (backward weighs their outputs by the router's
    weights, so it reads them); its last GEMM is the shared experts' w2 (added, never read)."""

    def per_block(s: ShapeLike, i: int) -> int:
        if getattr(s, "num_experts", 0) > 0 and is_moe_layer(s, i):
            last = getattr(s, "num_shared_experts", 0) * s.hidden * expert_ffn(s)
        else:
            last = s.hidden * s.ffn_hidden  # w2 (SwiGLU) or fc2 (GeLU)
        return block_matmul_params(s, i) - last

    return _over_blocks(a, per_block)


def hardware_flops_per_token(a: ShapeLike, seq_len: float, recompute: str = "none") -> float:
    """Model FLOPs plus what recomputation repeats, as it runs (tests/unit/test_gemm_census.py holds a
    step to it): full: the blocks' forward again but for each dense block's last GEMM and the
    head (``recomputed_matmul_params``), and the attention core's forward; selective: only the
    attention core (scores, softmax, weighted sum) runs again."""
    base = model_flops_per_token(a, seq_len)
    if recompute == "full":
        return base + 2.0 * recomputed_matmul_params(a) + attention_flops_per_token(a, seq_len)
    if recompute == "selective":
        return base + attention_flops_per_token(a, seq_len)
    return base
