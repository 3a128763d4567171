"""Parameters and FLOPs per token: the numerator of MFU and HFU, and the one count the
planner and the pipeline's stage balancing use too.

Every function takes a duck-typed shape: anything with ``hidden``, ``layers``, ``heads``,
``kv_heads``, ``head_dim``, ``ffn_hidden``, ``vocab_size``, ``tie_embeddings``, and
optionally ``mlp`` ("swiglu" | "gelu"; default swiglu), ``max_positions`` (learned
position embeddings, GPT-style; default 0) and ``qk_norm`` (default False). A
``ModelArgs`` and the planner's ``Shape`` both are one.

Parameters: a block has wq, wo (hidden x heads*head_dim), wk, wv (hidden x
kv_heads*head_dim), the MLP (SwiGLU: three hidden x ffn matrices; GeLU: two), two norms
of size hidden (LayerNorm, with the GeLU MLP, also has a bias of that size) and, with
QK-norm, two of size head_dim. Linear layers have no biases. Outside the blocks: the
token (and learned position) embedding, the final norm (hidden) and the head (vocab x
hidden; none when tied to the embedding).

FLOPs (the convention PaLM, Megatron-LM and torchtitan use, so MFU compares with
published numbers): a matmul of an (m, k) by (k, n) matrix costs 2mkn; the backward
pass costs twice the forward. Per token and layer, attention scores (QK^T) and the
weighted sum (AV) each cost 2 * seq * (heads * head_dim) in the forward pass, counted
over the FULL seq x seq square even though causal masking makes half of it zeros —
kernels like FlashAttention skip that half, so on them the real work is lower than
this count and MFU is slightly optimistic. Embedding lookups are not matmuls and are
not counted; the output head is (also when tied to the embedding). Norms, RoPE and
activations are not counted.
"""

from __future__ import annotations

from typing import Any

ShapeLike = Any  # duck-typed: see the module docstring


def _gelu(a: ShapeLike) -> bool:
    return getattr(a, "mlp", "swiglu") == "gelu"


def block_matmul_params(a: ShapeLike) -> int:
    """Weights of one block's matmuls (attention projections and MLP)."""
    attn = 2 * a.hidden * a.heads * a.head_dim + 2 * a.hidden * a.kv_heads * a.head_dim
    return attn + (2 if _gelu(a) else 3) * a.hidden * a.ffn_hidden


def block_params(a: ShapeLike) -> int:
    """All parameters of one block: matmul weights plus norms (and LayerNorm biases)."""
    norms = 2 * a.hidden * (2 if _gelu(a) else 1)
    qk = 2 * a.head_dim if getattr(a, "qk_norm", False) else 0
    return block_matmul_params(a) + norms + qk


def embedding_params(a: ShapeLike) -> int:
    """Token embedding plus learned position embeddings (GPT-style; none with RoPE)."""
    return (a.vocab_size + getattr(a, "max_positions", 0)) * a.hidden


def head_params(a: ShapeLike) -> int:
    """The output head's own weights: none when tied to the embedding."""
    return 0 if a.tie_embeddings else a.vocab_size * a.hidden


def matmul_params(a: ShapeLike) -> int:
    """Parameters that take part in a matmul per token (all linear weights, incl. the head)."""
    return a.layers * block_matmul_params(a) + a.vocab_size * a.hidden


def num_params(a: ShapeLike) -> int:
    """All parameters, counting a tied embedding/head once."""
    return a.layers * block_params(a) + embedding_params(a) + head_params(a) + a.hidden


def attention_flops_per_token(a: ShapeLike, seq_len: int) -> float:
    """Forward-pass FLOPs of scores and weighted sum, per token, all layers."""
    return 4.0 * a.layers * seq_len * a.heads * a.head_dim


def model_flops_per_token(a: ShapeLike, seq_len: int) -> float:
    """Forward + backward model FLOPs per token: 6N + 12 * layers * seq * heads * head_dim."""
    return 6.0 * matmul_params(a) + 3.0 * attention_flops_per_token(a, seq_len)


def block_flops_per_token(a: ShapeLike, seq_len: int) -> float:
    """Forward + backward model FLOPs of one block per token (its matmuls and attention core)."""
    return 6.0 * block_matmul_params(a) + 12.0 * seq_len * a.heads * a.head_dim


def head_flops_per_token(a: ShapeLike) -> float:
    """Forward + backward FLOPs of the output head per token."""
    return 6.0 * a.vocab_size * a.hidden


def hardware_flops_per_token(a: ShapeLike, seq_len: int, recompute: str = "none") -> float:
    """Model FLOPs plus what recomputation repeats.

    full: the whole forward runs again in backward (+2N + attention forward);
    selective: only the attention core (scores, softmax, weighted sum) runs again.
    """
    base = model_flops_per_token(a, seq_len)
    if recompute == "full":
        return base + 2.0 * matmul_params(a) + attention_flops_per_token(a, seq_len)
    if recompute == "selective":
        return base + attention_flops_per_token(a, seq_len)
    return base
