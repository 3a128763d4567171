"""A transformer described by its shape alone: Llama-style (SwiGLU, RoPE, GQA) or
GPT-style (4h GeLU MLP, learned positions), with parameter and FLOP counts."""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.errors import ConfigError


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    mlp: str = "swiglu"  # "swiglu" | "gelu"
    tie_embeddings: bool = False
    max_positions: int = 0  # learned position embeddings (GPT-style); 0: rotary
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.mlp not in ("swiglu", "gelu"):
            raise ConfigError(f"--mlp {self.mlp!r} must be swiglu or gelu")
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"--{k.replace('_', '-')} must be > 0")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(
                f"hidden {self.hidden} must be a multiple of heads {self.heads}, and heads of kv_heads {self.kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def block_params(self) -> int:
        h, f = self.hidden, self.ffn_hidden
        attn = 2 * h * h + 2 * h * self.kv_dim
        mlp = (3 if self.mlp == "swiglu" else 2) * h * f
        norms = 2 * h * (2 if self.mlp == "gelu" else 1)  # LayerNorm has a bias
        return attn + mlp + norms

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.max_positions * self.hidden

    def head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    def num_params(self) -> int:
        return self.layers * self.block_params() + self.embedding_params() + self.head_params() + self.hidden

    def matmul_params(self) -> int:
        h = self.hidden
        per_layer = 2 * h * h + 2 * h * self.kv_dim + (3 if self.mlp == "swiglu" else 2) * h * self.ffn_hidden
        return self.layers * per_layer + self.vocab * h

    def model_flops_per_token(self, seq: int) -> float:
        """6N + 12·L·s·h (full attention square), as models/flops.py counts it."""
        return 6.0 * self.matmul_params() + 12.0 * self.layers * seq * self.hidden

    def hardware_flops_per_token(self, seq: int, recompute: str) -> float:
        base = self.model_flops_per_token(seq)
        attn_fwd = 4.0 * self.layers * seq * self.hidden
        if recompute == "full":
            return base + 2.0 * self.matmul_params() + attn_fwd
        if recompute == "selective":
            return base + attn_fwd
        return base


def from_preset(name: str) -> Shape:
    from meshforge.models.presets import PRESETS

    if name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown model preset {name!r}; {hint}presets: {', '.join(PRESETS)}")
    return from_args(PRESETS[name], name)


def from_args(a, name: str = "config") -> Shape:
    """A meshforge ModelArgs (Llama-style) as a Shape."""
    return Shape(
        a.layers, a.hidden, a.heads, a.kv_heads, a.ffn_hidden, a.vocab_size, "swiglu", a.tie_embeddings, 0, name
    )
