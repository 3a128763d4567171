"""The one model-shape type: ``ModelShape``, spelled as the [model] config keys.

The model (models/llama.py), the layout rules (parallel/dims/), FLOP counting
(models/flops.py), the planner and the explorer all read this one type; the [model]
config section is derived from its fields (config.py), less ``ANALYSIS_ONLY``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ANALYSIS_ONLY = ("mlp", "max_positions", "attention", "name")  # fields that are no [model] config keys


@dataclass
class ModelShape:
    """A model's shape, spelled as the [model] config keys (models/presets.py fills it from a
    preset and the config; the planner builds one from its flags). ``ANALYSIS_ONLY`` fields
    describe models the planner prices but meshforge does not train (GPT-style) and are
    no config keys."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int = 0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    init_std: float = 0.02
    head_dim: int = 0  # 0 or None: hidden // heads, resolved whenever read (see _get_head_dim below)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    # mixture of experts (models/moe.py); num_experts = 0: a dense model
    num_experts: int = 0
    experts_per_token: int = 2  # top-k
    num_shared_experts: int = 0  # always-on experts of moe_ffn_hidden each
    moe_ffn_hidden: int = 0  # hidden size of one expert; 0: ffn_hidden
    moe_interval: int = 1  # every n-th block (from first_dense_layers on) is MoE, the rest dense
    first_dense_layers: int = 0  # the first blocks stay dense
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk: bool = True  # renormalise the chosen experts' weights to sum to 1
    capacity_factor: float = 0.0  # 0: dropless; > 0: each expert takes cf x tokens x k / E per micro-batch
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coeff: float = 0.01  # Switch/GShard balance loss E * sum(f_i * P_i) weight
    bias_update_rate: float = 1e-3  # DeepSeek-V3 auxiliary-loss-free bias step per optimizer step
    z_loss_coeff: float = 0.0  # router z-loss weight (mean squared logsumexp of the router logits)
    # analysis only (the planner): GPT-style MLP and learned positions, the attention kernel, a display name
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    max_positions: int = 0  # learned position embeddings (GPT-style); 0: rotary
    # "flash": a fused attention kernel (no s x s scores kept); "materialized": scores written out
    attention: Literal["flash", "materialized"] = "flash"
    name: str = ""  # the preset or file the shape came from (reports only)

    @property
    def explicit_head_dim(self) -> bool:
        """Whether head_dim was set rather than derived from hidden // heads."""
        return bool(self.__dict__.get("head_dim"))

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # The counts are models/flops.py's, the one place they are defined (imported on use: this
    # type stays torch-free for the layout rules and the planner).

    def block_params(self) -> int:
        from meshforge.models import flops

        return flops.block_params(self)

    def embedding_params(self) -> int:
        from meshforge.models import flops

        return flops.embedding_params(self)

    def head_params(self) -> int:
        from meshforge.models import flops

        return flops.head_params(self)

    def num_params(self) -> int:
        from meshforge.models import flops

        return flops.num_params(self)

    def matmul_params(self) -> int:
        from meshforge.models import flops

        return flops.matmul_params(self)

    def active_params(self) -> int:
        """Parameters a token uses (an MoE block's chosen and shared experts only)."""
        from meshforge.models import flops

        return flops.active_params(self)

    def model_flops_per_token(self, seq: int) -> float:
        """6N + 12·L·s·heads·head_dim (full attention square)."""
        from meshforge.models import flops

        return flops.model_flops_per_token(self, seq)

    def hardware_flops_per_token(self, seq: int, recompute: str) -> float:
        from meshforge.models import flops

        return flops.hardware_flops_per_token(self, seq, recompute)


def _get_head_dim(self: ModelShape) -> int:
    return self.__dict__.get("head_dim") or (self.hidden // self.heads if self.heads else 0)


def _set_head_dim(self: ModelShape, value: int | None) -> None:
    self.__dict__["head_dim"] = int(value or 0)  # the raw value: 0 stays "derived"


# head_dim is a dataclass field (a config key, saved in checkpoints) whose reads resolve
# 0 to hidden // heads at that moment: a preset's derived head_dim follows hidden/heads
# overrides laid over it later, while an explicit value sticks. The instance __dict__
# keeps the raw value (so copy.copy and ModelShape(**a.__dict__) keep "derived");
# dataclasses.replace and asdict see the resolved value.
ModelShape.head_dim = property(_get_head_dim, _set_head_dim)  # type: ignore[assignment]
