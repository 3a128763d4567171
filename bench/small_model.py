"""The small Llama shape the CPU benchmarks train, as `meshforge train` overrides."""

from __future__ import annotations


def small_model(hidden: int, layers: int, seq_len: int) -> dict:
    """64-wide heads, 2 key/value heads, a 3h SwiGLU MLP."""
    return {
        "model.hidden": hidden,
        "model.layers": layers,
        "model.heads": hidden // 64,
        "model.kv_heads": 2,
        "model.ffn_hidden": 3 * hidden,
        "train.seq_len": seq_len,
    }
