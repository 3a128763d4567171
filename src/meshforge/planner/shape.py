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
    # mixture of experts (models/moe.py; 0 experts: dense): routed experts, top-k, one expert's
    # hidden size (0: ffn_hidden), always-on experts, every n-th block MoE from first_dense_layers;
    # capacity_factor: 0 dropless, > 0 each expert takes at most cf x tokens x k / E per micro-batch
    num_experts: int = 0
    experts_per_token: int = 2
    moe_ffn_hidden: int = 0
    num_shared_experts: int = 0
    moe_interval: int = 1
    first_dense_layers: int = 0
    capacity_factor: float = 0.0

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
        _check_experts(self)

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

    def active_params(self) -> int:
        """Parameters a token uses (an MoE block's chosen and shared experts only)."""
        return flops.active_params(self)

    def model_flops_per_token(self, seq: int) -> float:
        """6N + 12·L·s·heads·head_dim (full attention square)."""
        return flops.model_flops_per_token(self, seq)

    def hardware_flops_per_token(self, seq: int, recompute: str) -> float:
        return flops.hardware_flops_per_token(self, seq, recompute)


def _check_experts(s: Shape) -> None:
    """Refuse an MoE shape that cannot exist, naming the flag."""
    if s.num_experts < 0 or s.num_shared_experts < 0 or s.moe_ffn_hidden < 0:
        raise ConfigError("--experts, --shared-experts and --moe-ffn-hidden must be >= 0")
    if s.capacity_factor < 0:
        raise ConfigError(f"--capacity-factor {s.capacity_factor} must be >= 0 (0: dropless, e.g. 1.25)")
    if s.num_experts and not 1 <= s.experts_per_token <= s.num_experts:
        raise ConfigError(
            f"--top-k {s.experts_per_token} must be between 1 and --experts {s.num_experts} (experts per token)"
        )


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
        num_experts=a.num_experts,
        experts_per_token=a.experts_per_token,
        moe_ffn_hidden=a.moe_ffn_hidden,
        num_shared_experts=a.num_shared_experts,
        moe_interval=a.moe_interval,
        first_dense_layers=a.first_dense_layers,
        capacity_factor=a.capacity_factor,
    )
