"""FLOPs per token: the numerator of MFU and HFU.

Convention (the one PaLM, Megatron-LM and torchtitan use, so MFU compares with
published numbers): a matmul of an (m, k) by (k, n) matrix costs 2mkn; the backward
pass costs twice the forward. Per token and layer, attention scores (QK^T) and the
weighted sum (AV) each cost 2 * seq * (heads * head_dim) in the forward pass, counted
over the FULL seq x seq square even though causal masking makes half of it zeros —
kernels like FlashAttention skip that half, so on them the real work is lower than
this count and MFU is slightly optimistic. Embedding lookups are not matmuls and are
not counted; the output head is (also when tied to the embedding).
"""

from __future__ import annotations

from meshforge.models.llama import ModelArgs


def matmul_params(a: ModelArgs) -> int:
    """Parameters that take part in a matmul per token (all linear weights, incl. the head)."""
    hd = a.head_dim
    attn = a.hidden * a.heads * hd * 2 + a.hidden * a.kv_heads * hd * 2
    ffn = 3 * a.hidden * a.ffn_hidden
    return a.layers * (attn + ffn) + a.vocab_size * a.hidden


def num_params(a: ModelArgs) -> int:
    """All parameters, counting a tied embedding/head once."""
    norms = a.layers * 2 * a.hidden + a.hidden
    emb = a.vocab_size * a.hidden
    return matmul_params(a) + norms + (0 if a.tie_embeddings else emb)


def attention_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """Forward-pass FLOPs of scores and weighted sum, per token, all layers."""
    return 4.0 * a.layers * seq_len * a.heads * a.head_dim


def model_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """Forward + backward model FLOPs per token: 6N + 12 * layers * seq * hidden_attn."""
    return 6.0 * matmul_params(a) + 3.0 * attention_flops_per_token(a, seq_len)


def hardware_flops_per_token(a: ModelArgs, seq_len: int, recompute: str = "none") -> float:
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
