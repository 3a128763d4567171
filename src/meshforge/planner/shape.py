"""A transformer described by its shape alone: Llama-style (SwiGLU, RoPE, GQA) or
GPT-style (4h GeLU MLP, learned positions), with parameter and FLOP counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.errors import ConfigError
from meshforge.models import flops
from meshforge.models.presets import get_preset

if TYPE_CHECKING:
    from meshforge.models.llama import ModelArgs


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
    head_dim: int = 0  # 0: hidden // heads
    qk_norm: bool = False
    # "flash": a fused attention kernel (no s x s scores kept); "materialized": scores,
    # softmax and dropout written out (Megatron-LM before FlashAttention)
    attention: str = "flash"

    def __post_init__(self) -> None:
        if self.attention not in ("flash", "materialized"):
            raise ConfigError(f"--attention {self.attention!r} must be flash or materialized")
        if self.mlp not in ("swiglu", "gelu"):
            raise ConfigError(f"--mlp {self.mlp!r} must be swiglu or gelu")
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"--{k.replace('_', '-')} must be > 0")
        if (not self.head_dim and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ConfigError(
                f"hidden {self.hidden} must be a multiple of heads {self.heads} (or head_dim given), and heads of "
                f"kv_heads {self.kv_heads}"
            )
        self.head_dim = self.head_dim or self.hidden // self.heads

    @property
    def vocab_size(self) -> int:
        """The vocabulary under ModelArgs' name, which models/flops.py reads."""
        return self.vocab

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # The counts are models/flops.py's, the one place they are defined.

    def block_params(self) -> int:
        return flops.block_params(self)

    def embedding_params(self) -> int:
        return flops.embedding_params(self)

    def head_params(self) -> int:
        return flops.head_params(self)

    def num_params(self) -> int:
        return flops.num_params(self)

    def matmul_params(self) -> int:
        return flops.matmul_params(self)

    def model_flops_per_token(self, seq: int) -> float:
        """6N + 12·L·s·heads·head_dim (full attention square)."""
        return flops.model_flops_per_token(self, seq)

    def hardware_flops_per_token(self, seq: int, recompute: str) -> float:
        return flops.hardware_flops_per_token(self, seq, recompute)


def from_preset(name: str) -> Shape:
    """A named preset (models/presets.py) as a Shape; an unknown name is refused there."""
    return from_args(get_preset(name), name)


def from_args(a: ModelArgs, name: str = "config") -> Shape:
    """A meshforge ModelArgs (Llama-style) as a Shape."""
    return Shape(
        a.layers,
        a.hidden,
        a.heads,
        a.kv_heads,
        a.ffn_hidden,
        a.vocab_size,
        "swiglu",
        a.tie_embeddings,
        0,
        name,
        a.head_dim,
        a.qk_norm,
    )
