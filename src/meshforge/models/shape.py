"""The one model-shape type: ``ModelShape``, spelled as the [model] config keys.

The model (models/llama.py), the layout rules (parallel/rules.py), FLOP counting
(models/flops.py), the planner and the explorer all read this one type; its fields are the
[model] config keys (config/keys.py reads them, docstrings included), less ``ANALYSIS_ONLY``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from meshforge.ranges import BLOCKS, TOKENS, WIDTH, WORDS, Span, ranged, unit, whole

# train.loss_chunk_size's default (models/chunked_loss.py): tokens per chunk, 0.5 GiB of fp32 logits at
# 128K vocab. Here, beside the shape, so that the config and the planner read it without importing torch.
LOSS_CHUNK_SIZE = 1024


@dataclass
class ModelShape:
    """A model's shape, each field one [model] config key declared here once (its docstring is
    its help; models/presets.py fills it from a preset and the config; the planner builds one
    from its flags). Fields with ``config: False`` metadata describe models the planner prices
    but meshforge does not train (GPT-style) and are no config keys."""

    hidden: int = ranged(whole(1, WIDTH))
    """model width"""
    layers: int = ranged(whole(1, BLOCKS))
    """number of transformer blocks"""
    heads: int = ranged(whole(1, BLOCKS))
    """attention heads (must divide `hidden`)"""
    kv_heads: int = ranged(whole(1, BLOCKS))
    """key/value heads for grouped-query attention (must divide `heads`)"""
    ffn_hidden: int = ranged(whole(1, WIDTH))
    """SwiGLU inner width"""
    vocab_size: int = ranged(whole(1, 2**25), **{WORDS: ("auto",)})
    """embedding rows; must be ≥ the tokenizer's vocabulary. `auto` (the default; `meshforge train` only): a
    `tokenizer.json`'s vocabulary rounded up to a multiple of 64; the preset's with the byte tokenizer or
    `model.init_from` (whose weights it must match)"""
    max_seq_len: int = ranged(whole(1, TOKENS), 0)
    """longest sequence the model accepts (`train.seq_len` must not exceed it)"""
    norm_eps: float = ranged(unit(lo_open=True), 1e-5)
    """RMSNorm epsilon"""
    tie_embeddings: bool = False
    """share the embedding and output head weights"""
    rope_theta: float = ranged(Span(1.0, 1e12), 10000.0)
    """RoPE base"""
    rope_scaling: Literal["none", "llama3"] = "none"
    """`none` or `llama3` (Llama 3.1 long-context frequency scaling)"""
    rope_factor: float = ranged(Span(0.0, 1e4, lo_open=True), 8.0)
    """llama3 scaling factor"""
    rope_low_freq_factor: float = ranged(Span(0.0, 1e4, lo_open=True), 1.0)
    """llama3 scaling: low-frequency band edge"""
    rope_high_freq_factor: float = ranged(Span(0.0, 1e4, lo_open=True), 4.0)
    """llama3 scaling: high-frequency band edge"""
    rope_original_max_seq_len: int = ranged(whole(1, TOKENS), 8192)
    """llama3 scaling: the context length the frequencies were trained for"""
    init_std: float = ranged(unit(lo_open=True), 0.02)
    """std of the normal init (residual output projections get std/√(2·layers))"""
    head_dim: int = ranged(whole(0, 2**16), 0)
    """width of one attention head; 0: `hidden / heads` (Qwen3 and others set it so that heads × head_dim ≠
    hidden); must be even (RoPE)"""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before RoPE (Qwen3); not yet with `parallel.tp > 1`"""
    num_experts: int = ranged(whole(0, 2**20), 0)
    """mixture of experts ([moe.md](moe.md)): routed experts per MoE block; 0: a dense model"""
    experts_per_token: int = ranged(whole(1, 2**20), 2)
    """top-k: experts each token is sent to (1 ≤ k ≤ `num_experts`)"""
    num_shared_experts: int = ranged(whole(0, 2**10), 0)
    """always-on experts of `moe_ffn_hidden` each, added to every token's output"""
    moe_ffn_hidden: int = ranged(whole(0, WIDTH), 0)
    """SwiGLU width of one expert; 0: `ffn_hidden`"""
    moe_interval: int = ranged(whole(1, BLOCKS), 1)
    """every n-th block (counted from `first_dense_layers`) is MoE, the others dense"""
    first_dense_layers: int = ranged(whole(0, BLOCKS), 0)
    """the first blocks that stay dense"""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """`softmax` or `sigmoid` router scores (fp32)"""
    norm_topk: bool = True
    """renormalise the chosen experts' weights to sum to 1"""
    capacity_factor: float = ranged(unit(1e3), 0.0)
    """0: dropless; > 0: each expert takes at most ⌈cf × tokens × k / E⌉ tokens per micro-batch, the
    lowest-scoring overflow is dropped (and counted)"""
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    """`aux_loss` (Switch/GShard E·Σfᵢ·Pᵢ), `bias` (DeepSeek-V3 auxiliary-loss-free bias, checkpointed) or
    `none`"""
    aux_loss_coeff: float = ranged(unit(1e3), 0.01)
    """weight of the balance loss (`load_balance = "aux_loss"`)"""
    bias_update_rate: float = ranged(unit(1.0), 1e-3)
    """bias step per optimizer step, × sign(mean load − load) (`load_balance = "bias"`)"""
    z_loss_coeff: float = ranged(unit(1e3), 0.0)
    """router z-loss weight (mean squared log-sum-exp of the router logits); 0: off"""
    mlp: Literal["swiglu", "gelu"] = field(default="swiglu", metadata={"config": False})
    """the planner only: GPT-style GELU MLP"""
    max_positions: int = field(default=0, metadata={"config": False})
    """the planner only: learned position embeddings (GPT-style); 0: rotary"""
    attention: Literal["flash", "materialized"] = field(default="flash", metadata={"config": False})
    """the planner only: "flash", a fused attention kernel (no s x s scores kept); "materialized": scores
    written out"""
    name: str = field(default="", metadata={"config": False})
    """the preset or file the shape came from (reports only)"""

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


ANALYSIS_ONLY = tuple(f.name for f in fields(ModelShape) if f.metadata.get("config") is False)

# head_dim is a dataclass field (a config key, saved in checkpoints) whose reads resolve
# 0 to hidden // heads at that moment: a preset's derived head_dim follows hidden/heads
# overrides laid over it later, while an explicit value sticks. The instance __dict__
# keeps the raw value (so copy.copy and ModelShape(**a.__dict__) keep "derived");
# dataclasses.replace and asdict see the resolved value.
ModelShape.head_dim = property(_get_head_dim, _set_head_dim)  # type: ignore[assignment]
